"""Rebuilding lock_state from the log gives the identical table (DESIGN.md, "Read side").

A seeded random workload of acquires, reservations of two resources at once (so rows name their
reservation), renews, releases, hand-offs (accepted, declined or left to lapse) and force-releases with
short TTLs (some leases are left to lapse, some found lapsed by the next acquire, some reaped) runs
through the real command path; then the whole lock_state table is snapshotted, rebuilt from the events
alone, and compared row for row. The projection of this test's streams must also equal a plain fold
of their events by the pure decider.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass

import asyncpg
import pytest

from domain.commands import Accept, Acquire, Command, Decline, ForceRelease, HandOff, Release, Renew
from domain.decider import fold
from domain.errors import DomainError
from domain.events import event_from_payload
from domain.reservation import Reserve
from domain.resource import TtlBounds
from domain.state import LockState
from projections.rebuild import rebuild_lock_state
from projections.schema import lock_state_from_row
from service.composition import lock_service_on_pool, reservation_service_on_pool
from service.lock_service import CommandContext, LockService
from service.outcomes import Granted, HandedOff
from service.reaper_store import expire_due
from service.reservation_service import ReservationService

pytestmark = pytest.mark.storage

RESOURCES = 20
COMMANDS = 400
TRIP_RESOURCES = 6  # taken by reservations of two, and now and then by a single acquire
HANDOFF_RESOURCES = 2  # one hand-off accepted, one declined, at the end


@dataclass
class _Lease:
    owner: str
    token: int


async def _workload(
    service: LockService, reservations: ReservationService, service_pool: asyncpg.Pool, prefix: str, seed: int
) -> Counter[str]:
    rng = random.Random(seed)
    trips = random.Random(seed + 1)  # its own generator: the other commands are drawn as they always were
    trip_resources = [f"{prefix}trip{i}" for i in range(TRIP_RESOURCES)]
    resources = [f"{prefix}res{i:02d}" for i in range(RESOURCES)]
    leases: dict[str, _Lease] = {}  # the last lease granted per resource, as far as the client knows
    handed: dict[str, str] = {}  # the receiver of the last hand-off per resource
    outcomes: Counter[str] = Counter()

    def command_for(resource: str) -> Command:
        lease = leases.get(resource)
        roll = rng.random()
        receiver = handed.get(resource)
        if receiver is not None and roll < 0.3:
            accept_ttl = rng.choice([20, 80, 5_000])
            return Accept(resource, receiver, accept_ttl) if roll < 0.2 else Decline(resource, receiver)
        if lease is None or roll < 0.35:
            return Acquire(resource, f"bot{rng.randint(1, 4)}", rng.choice([15, 30, 60, 120, 5_000]))
        token = lease.token if rng.random() < 0.9 else lease.token + rng.choice([-1, 1])
        if roll < 0.65:
            ttl = rng.choice([None, 20, 80, 5_000])
            return Renew(resource, lease.owner, max(token, 1), ttl)
        if roll < 0.82:
            return Release(resource, lease.owner, max(token, 1))
        if roll < 0.95:
            within = rng.choice([15, 60, 5_000])
            return HandOff(resource, lease.owner, max(token, 1), f"bot{rng.randint(1, 4)}", within)
        return ForceRelease(resource, "operator test")

    async def run(command: Command | Reserve) -> None:
        ctx = CommandContext(principal="rebuild-test")
        try:
            if isinstance(command, Reserve):
                reserved = (await reservations.execute(command, ctx)).outcome
                outcomes[f"Reserve:{type(reserved).__name__}"] += 1
                return
            result = await service.execute(command, ctx)
        except DomainError as error:
            outcomes[f"{type(command).__name__}:{error.code}"] += 1
            return
        outcomes[f"{type(command).__name__}:{type(result.outcome).__name__}"] += 1
        if isinstance(result.outcome, Granted) and isinstance(command, Acquire | Accept):
            leases[command.resource] = _Lease(result.outcome.owner, result.outcome.fencing_token)
        if isinstance(result.outcome, HandedOff):
            handed[command.resource] = result.outcome.owner

    def trip_command() -> Command | Reserve:
        pair = tuple(trips.sample(trip_resources, 2))
        owner, ttl_ms = f"bot{trips.randint(1, 4)}", trips.choice([20, 80, 200])
        if trips.random() < 0.2:
            return Acquire(pair[0], owner, ttl_ms)
        return Reserve(f"trip-{trips.randint(1, 50)}", pair, owner, ttl_ms)

    sent = 0
    while sent < COMMANDS:
        # A few commands at once, sometimes on the same resource, so decisions also lose races and retry.
        wave: list[Command | Reserve] = [
            command_for(rng.choice(resources)) for _ in range(min(rng.randint(1, 8), COMMANDS - sent))
        ]
        sent += len(wave)
        if trips.random() < 0.3:
            wave.append(trip_command())
        await asyncio.gather(*(run(c) for c in wave))
        if rng.random() < 0.15:
            await asyncio.sleep(rng.uniform(0.02, 0.15))  # let short leases lapse
        if rng.random() < 0.03:
            async with service_pool.acquire() as conn:
                await expire_due(conn, 1000, f"{prefix}reaper")
    # A hand-off accepted and one declined, whatever the waves' timing gave: the comparison needs both.
    for answered in ("accepted", "declined"):
        resource = f"{prefix}handoff-{answered}"
        await run(Acquire(resource, "bot1", 5_000))
        await run(HandOff(resource, "bot1", leases[resource].token, "bot2", 5_000))
        await run(Accept(resource, "bot2", 5_000) if answered == "accepted" else Decline(resource, "bot2"))
    await asyncio.sleep(0.13)
    async with service_pool.acquire() as conn:
        outcomes["reaped"] += len(await expire_due(conn, 1000, f"{prefix}reaper"))
    return outcomes


async def test_rebuild_reproduces_lock_state_and_equals_a_fold_of_the_log(
    service_pool: asyncpg.Pool, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    bounds = TtlBounds(min_ms=10, max_ms=60_000, default_ms=30_000)
    service = lock_service_on_pool(service_pool, bounds)
    reservations = reservation_service_on_pool(service_pool, service, bounds)
    outcomes = await _workload(service, reservations, service_pool, unique_prefix, seed=7)
    print(f"\nworkload outcomes: {dict(sorted(outcomes.items()))}")
    # The workload reached the interesting states, or the comparison below proves little.
    reached = (
        "Acquire:Granted",
        "Renew:Granted",
        "Release:Released",
        "Renew:lease_expired",
        "Acquire:lock_held",
        "HandOff:HandedOff",
        "Accept:Granted",
        "Decline:Released",
        "Reserve:Reservation",
    )
    for outcome in reached:
        assert outcomes[outcome] > 0, outcome

    async with admin_pool.acquire() as conn:
        # One transaction, the table locked first: no command or reaper can change lock_state between the
        # two snapshots (they need a row lock on it), and a failed comparison rolls the rebuild back.
        async with conn.transaction():
            await conn.execute("LOCK TABLE lock_state IN EXCLUSIVE MODE")
            before = [dict(r) for r in await conn.fetch("SELECT * FROM lock_state ORDER BY resource")]
            rows = await rebuild_lock_state(conn)
            after = [dict(r) for r in await conn.fetch("SELECT * FROM lock_state ORDER BY resource")]
            assert rows == len(before)
            assert any(row["reservation_id"] for row in before if row["resource"].startswith(unique_prefix))
            assert len(after) == len(before)
            for old, new in zip(before, after, strict=True):
                assert new == old
        events = await conn.fetch(
            "SELECT stream_id, event_type, data::text AS data FROM events"
            " WHERE starts_with(stream_id, $1) ORDER BY stream_id, stream_version",
            unique_prefix,
        )
        projected = await conn.fetch(
            "SELECT * FROM lock_state WHERE starts_with(resource, $1) ORDER BY resource", unique_prefix
        )

    streams: dict[str, list[asyncpg.Record]] = {}
    for event in events:
        streams.setdefault(event["stream_id"], []).append(event)
    assert len(streams) == len(projected)
    assert RESOURCES + HANDOFF_RESOURCES < len(projected) <= RESOURCES + TRIP_RESOURCES + HANDOFF_RESOURCES
    ended_by: Counter[str | None] = Counter()
    for row in projected:
        resource = row["resource"]
        folded = fold(
            LockState(resource),
            [event_from_payload(resource, e["event_type"], json.loads(e["data"])) for e in streams[resource]],
        )
        assert folded == lock_state_from_row(resource, row)
        ended_by[folded.ended_by] += 1
    print(f"final states of the {len(projected)} streams by ended_by: {dict(ended_by)}")
