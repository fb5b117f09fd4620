"""The reaper (DESIGN.md, "Expiry") on PostgreSQL: abandoned leases expire promptly, several reapers share
the work without doing any of it twice, a renew that committed first is never expired, and a command
decided before the deadline but appended after it sees the expiry. The purge of old Idempotency-Keys and
the pass's behaviour on the fakes: tests/service/test_sagas_and_reaper.py and the contract suite.

Measured figures are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg
import httpx
import pytest

from domain.commands import Acquire, ForceRelease, Release, Renew
from domain.errors import LeaseExpired
from domain.events import LOCK_ACQUIRED, LOCK_EXPIRED, LOCK_RENEWED
from domain.resource import TtlBounds
from service.composition import lock_service_on_pool, reaper_on_pool
from service.config import Settings
from service.database import create_pool
from service.lock_service import CommandContext, LockService
from service.outcomes import ForceReleased, Granted
from service.reaper import Reaper
from service.reaper_store import expire_due
from tests.assertions import granted

if TYPE_CHECKING:
    from tests.servers import ServerProcess

pytestmark = pytest.mark.storage

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# --- (a) an abandoned lease, over HTTP, with the shared server's reaper (every 100 ms) -------------------


async def test_abandoned_lease_expires_within_a_second_of_its_deadline(
    http: httpx.AsyncClient, resource: str
) -> None:
    acquired = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": 1000})
    assert acquired.status_code == 201
    lease = acquired.json()
    deadline = datetime.fromisoformat(lease["expires_at"])

    expired: list[dict[str, Any]] = []
    give_up = time.monotonic() + 1.0 + 3.0  # the TTL, then more than the 1 s the contract allows
    while not expired and time.monotonic() < give_up:
        await asyncio.sleep(0.02)
        history = await http.get(f"/v1/locks/{resource}/history")
        assert history.status_code == 200
        expired = [e for e in history.json()["events"] if e["type"] == LOCK_EXPIRED]
    assert len(expired) == 1, "no LOCK_EXPIRED within TTL + 3 s"
    event = expired[0]
    lateness = (datetime.fromisoformat(event["recorded_at"]) - deadline).total_seconds()
    print(f"\nexpiry lateness over HTTP: {lateness * 1000:.1f} ms")
    assert 0 <= lateness < 1.0  # never early, and less than a second late
    assert event["version"] == 2
    assert event["data"]["owner"] == "bot1"
    assert event["data"]["fencing_token"] == lease["fencing_token"] == 1
    assert datetime.fromisoformat(event["data"]["expires_at"]) == deadline
    assert event["metadata"]["actor"] == "reaper"
    # Its id is version 7 (RFC 9562) and carries the millisecond it was recorded, like every other event's.
    event_id = uuid.UUID(event["event_id"])
    assert (event_id.version, event_id.variant) == (7, uuid.RFC_4122)
    recorded_ms = (datetime.fromisoformat(event["recorded_at"]) - EPOCH) // timedelta(milliseconds=1)
    assert event_id.int >> 80 == recorded_ms

    late = await http.post(
        f"/v1/locks/{resource}/renew", json={"owner": "bot1", "fencing_token": lease["fencing_token"]}
    )
    assert late.status_code == 410
    assert late.json()["code"] == "lease_expired"

    successor = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot2", "ttl_ms": 5000})
    assert successor.status_code == 201
    assert successor.json()["fencing_token"] > lease["fencing_token"]
    history = (await http.get(f"/v1/locks/{resource}/history")).json()["events"]
    assert [e["type"] for e in history] == [LOCK_ACQUIRED, LOCK_EXPIRED, LOCK_ACQUIRED]


# --- (b) two reapers over 5,000 expired leases ------------------------------------------------------------


@contextlib.contextmanager
def _paused(server: ServerProcess) -> Iterator[None]:
    """SIGSTOP the shared server (and so its reaper) for the duration, then SIGCONT it.

    Its reaper expires every due lease in the database, whatever the prefix; left running, it would take a
    share of this test's leases (or all of them) and the split between the two reapers under test would
    mean nothing. It is paused before this test creates any lease, so it cannot hold a lock on one.
    """
    process = server.process
    assert process is not None
    assert process.poll() is None
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


@contextlib.asynccontextmanager
async def _pools(settings: Settings, count: int) -> AsyncIterator[list[asyncpg.Pool]]:
    pools: list[asyncpg.Pool] = []
    try:
        for _ in range(count):
            pools.append(await create_pool(settings))
        yield pools
    finally:
        for pool in pools:
            await pool.close()


async def _held_count(conn: asyncpg.pool.PoolConnectionProxy, prefix: str) -> int:
    count: int = await conn.fetchval(
        "SELECT count(*) FROM lock_state WHERE starts_with(resource, $1) AND status = 'held'", prefix
    )
    return count


@pytest.mark.slow
async def test_two_reapers_share_5000_expired_leases_exactly_once(
    server: ServerProcess,
    lock_service: LockService,
    admin_pool: asyncpg.Pool,
    settings: Settings,
    unique_prefix: str,
) -> None:
    total, batch = 5000, 200
    resources = [f"{unique_prefix}r{i:05d}" for i in range(total)]
    reaper_settings = Settings(
        database_url=settings.database_url, reaper_enabled=False, reaper_batch_size=batch
    )
    with _paused(server):
        started = time.monotonic()
        async with asyncio.timeout(60):
            for start in range(0, total, 250):
                results = await asyncio.gather(
                    *(
                        lock_service.execute(Acquire(r, "bot", 1000), CommandContext())
                        for r in resources[start : start + 250]
                    )
                )
                assert all(isinstance(r.outcome, Granted) for r in results)
        acquire_s = time.monotonic() - started
        async with admin_pool.acquire() as conn:
            assert await _held_count(conn, unique_prefix) == total
            remaining = await conn.fetchval(
                "SELECT extract(epoch FROM max(expires_at) - clock_timestamp())::float8 FROM lock_state"
                " WHERE starts_with(resource, $1)",
                unique_prefix,
            )
        await asyncio.sleep(max(remaining, 0.0) + 0.05)

        async with _pools(reaper_settings, 2) as pools:
            reapers = [
                reaper_on_pool(pool, reaper_settings, reaper_id=f"{unique_prefix}reaper-{i}")
                for i, pool in enumerate(pools)
            ]

            async def drive(reaper: Reaper) -> None:
                while True:
                    found = await reaper.run_once()
                    if found < batch:
                        async with admin_pool.acquire() as conn:
                            if await _held_count(conn, unique_prefix) == 0:
                                return
                        await asyncio.sleep(0.005)

            started = time.monotonic()
            async with asyncio.timeout(60):
                await asyncio.gather(*(drive(r) for r in reapers))
            reap_s = time.monotonic() - started

    async with admin_pool.acquire() as conn:
        streams = await conn.fetch(
            "SELECT stream_id, array_agg(event_type ORDER BY stream_version) AS types"
            "  FROM events WHERE starts_with(stream_id, $1) GROUP BY stream_id",
            unique_prefix,
        )
        split = await conn.fetch(
            "SELECT metadata ->> 'reaper_id' AS reaper_id, count(*) AS n FROM events"
            " WHERE starts_with(stream_id, $1) AND event_type = 'LOCK_EXPIRED' GROUP BY 1",
            unique_prefix,
        )
        states = await conn.fetch(
            "SELECT status, ended_by, version, count(*) AS n FROM lock_state"
            " WHERE starts_with(resource, $1) GROUP BY 1, 2, 3",
            unique_prefix,
        )
    assert len(streams) == total
    assert all(list(s["types"]) == [LOCK_ACQUIRED, LOCK_EXPIRED] for s in streams)
    assert [tuple(s) for s in states] == [("free", LOCK_EXPIRED, 2, total)]
    by_reaper = {row["reaper_id"]: row["n"] for row in split}
    print(
        f"\n5,000 leases: acquired in {acquire_s:.2f} s, reaped in {reap_s:.2f} s; split {by_reaper}"
        f" (reapers' own counters: {[r.expired_count for r in reapers]})"
    )
    assert set(by_reaper) == {r.reaper_id for r in reapers}  # both did some of the work, nobody else did
    assert sum(by_reaper.values()) == total
    for reaper in reapers:
        assert reaper.expired_count >= by_reaper[reaper.reaper_id]


# --- (c) renew racing the reaper near the deadline ----------------------------------------------------------


@dataclass(frozen=True)
class _Race:
    resource: str
    ttl_ms: int
    renew_after_s: float
    reap_after_s: float


@dataclass
class _Outcome:
    renewed_until: datetime | None  # the renewed deadline when the renew succeeded (200)
    lease_expired: bool  # the renew got 410 lease_expired


def _check_stream(resource: str, events: list[asyncpg.Record]) -> None:
    """A lease is never resurrected: no renew after its expiry (until a new acquire) or its deadline."""
    assert events[0]["event_type"] == LOCK_ACQUIRED
    live = False
    deadline: datetime | None = None
    for event in events:
        kind = event["event_type"]
        data = json.loads(event["data"])
        where = f"{resource} v{event['stream_version']} {kind}"
        if kind == LOCK_ACQUIRED:
            assert not live or event["recorded_at"] >= deadline, where
            live, deadline = True, datetime.fromisoformat(data["expires_at"])
        elif kind == LOCK_RENEWED:
            assert live, f"{where}: renewed after the lease ended"
            assert deadline is not None
            assert event["recorded_at"] < deadline, f"{where}: after the deadline"
            deadline = datetime.fromisoformat(data["expires_at"])
        elif kind == LOCK_EXPIRED:
            assert live, f"{where}: expired a lease that had ended"
            assert datetime.fromisoformat(data["expires_at"]) == deadline, where
            assert deadline is not None
            assert event["recorded_at"] >= deadline, f"{where}: expired early"
            live = False
        else:
            live = False


async def test_a_renew_that_commits_before_the_reaper_is_never_expired(
    service_pool: asyncpg.Pool, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    # Leases of tens of milliseconds so 200 races take seconds: a service with a lower TTL floor.
    service = lock_service_on_pool(service_pool, TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000))
    reaper_id = f"{unique_prefix}race-reaper"
    rng = random.Random(20261130)
    waves, per_wave = 25, 8
    outcomes: dict[str, _Outcome] = {}

    async def race(plan: _Race) -> None:
        acquired = await service.execute(Acquire(plan.resource, "bot", plan.ttl_ms), CommandContext())
        token = granted(acquired).fencing_token

        async def renew() -> _Outcome:
            await asyncio.sleep(plan.renew_after_s)
            try:
                result = await service.execute(Renew(plan.resource, "bot", token, 60_000), CommandContext())
            except LeaseExpired:
                return _Outcome(None, True)
            return _Outcome(granted(result).expires_at, False)

        async def reap() -> None:
            await asyncio.sleep(plan.reap_after_s)
            async with service_pool.acquire() as conn:
                await expire_due(conn, 1000, reaper_id)

        outcome, _ = await asyncio.gather(renew(), reap())
        outcomes[plan.resource] = outcome

    async with asyncio.timeout(120):
        for wave in range(waves):
            plans = []
            for i in range(per_wave):
                ttl_ms = rng.randint(40, 80)
                plans.append(
                    _Race(
                        f"{unique_prefix}race{wave:02d}-{i}",
                        ttl_ms,
                        ttl_ms / 1000 + rng.uniform(-0.025, 0.010),
                        ttl_ms / 1000 + rng.uniform(-0.010, 0.025),
                    )
                )
            await asyncio.gather(*(race(p) for p in plans))
        # A final sweep, so every lease that lapsed has its LOCK_EXPIRED (a renew may have been refused
        # before any reaper got there: it saw the deadline pass itself).
        await asyncio.sleep(0.1)
        async with service_pool.acquire() as conn:
            while await expire_due(conn, 1000, f"{unique_prefix}sweep"):
                pass

    async with admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT stream_id, stream_version, event_type, data::text AS data, metadata ->> 'reaper_id'"
            " AS reaper_id, recorded_at FROM events WHERE starts_with(stream_id, $1)"
            " ORDER BY stream_id, stream_version",
            unique_prefix,
        )
        state_rows = await conn.fetch(
            "SELECT * FROM lock_state WHERE starts_with(resource, $1)", unique_prefix
        )
    streams: dict[str, list[asyncpg.Record]] = {}
    for row in rows:
        streams.setdefault(row["stream_id"], []).append(row)
    states = {row["resource"]: row for row in state_rows}
    assert set(streams) == set(outcomes) == set(states)
    assert len(outcomes) == waves * per_wave

    expired_by_racing_reaper = 0
    for resource, outcome in outcomes.items():
        events = streams[resource]
        types = [e["event_type"] for e in events]
        state = states[resource]
        _check_stream(resource, events)
        assert state["version"] == len(events)
        if outcome.renewed_until is not None:
            assert types == [LOCK_ACQUIRED, LOCK_RENEWED], resource
            assert (
                datetime.fromisoformat(json.loads(events[1]["data"])["expires_at"]) == outcome.renewed_until
            )
            assert state["status"] == "held"
            assert state["expires_at"] == outcome.renewed_until
        else:
            assert outcome.lease_expired
            assert types == [LOCK_ACQUIRED, LOCK_EXPIRED], resource
            assert (state["status"], state["ended_by"]) == ("free", LOCK_EXPIRED)
            expired_by_racing_reaper += events[1]["reaper_id"] == reaper_id

    renewed = sum(o.renewed_until is not None for o in outcomes.values())
    refused = len(outcomes) - renewed
    print(
        f"\nrenew vs reaper, {len(outcomes)} races: {renewed} renewed (200), {refused} refused (410),"
        f" {expired_by_racing_reaper} of those expired by the racing reaper pass"
    )
    # Both sides of the race were exercised, or the test proved nothing.
    assert renewed > 0
    assert refused > 0

    for resource, outcome in outcomes.items():
        if outcome.renewed_until is not None:
            await service.execute(Release(resource, "bot", 1), CommandContext())


# --- decided while live, appended after the deadline ------------------------------------------------------


@contextlib.asynccontextmanager
async def _row_guard(admin_pool: asyncpg.Pool, resource: str) -> AsyncIterator[int]:
    """Hold FOR KEY SHARE on the resource's lock_state row until the block ends; yields the holder's pid.

    Reapers pass the row by (FOR UPDATE SKIP LOCKED), and a command waits at its serialization point (the
    FOR UPDATE on the stream head) after it has loaded and decided.
    """
    async with admin_pool.acquire() as conn, conn.transaction():
        locked = await conn.fetchval(
            "SELECT count(*) FROM (SELECT FROM lock_state WHERE resource = $1 FOR KEY SHARE) AS row", resource
        )
        assert locked == 1
        yield conn.get_server_pid()


async def _wait_until_blocked_by(admin_pool: asyncpg.Pool, pid: int) -> datetime:
    """The database clock once some backend waits for ``pid``'s lock."""
    async with admin_pool.acquire() as conn:
        for _ in range(500):
            now: datetime | None = await conn.fetchval(
                "SELECT clock_timestamp() FROM pg_stat_activity"
                " WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1",
                pid,
            )
            if now is not None:
                return now
            await asyncio.sleep(0.01)
    raise AssertionError("the command never reached the row lock")


@pytest.mark.parametrize("command", ["renew", "release", "force-release"])
async def test_a_command_decided_before_the_deadline_but_appended_after_it_sees_the_expiry(
    service_pool: asyncpg.Pool, admin_pool: asyncpg.Pool, resource: str, command: str
) -> None:
    """DESIGN.md: "A renew that reaches the database after the deadline fails even if it was decided a moment
    earlier." The same holds for release and force-release: at the instant of the append the lease has
    lapsed, so the log must say LOCK_EXPIRED (the decision at that instant), not that the holder or an
    operator ended a lease that was still live."""
    service = lock_service_on_pool(service_pool, TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000))
    acquired = await service.execute(Acquire(resource, "bot1", 300), CommandContext())
    deadline = granted(acquired).expires_at
    commands: dict[str, Renew | Release | ForceRelease] = {
        "renew": Renew(resource, "bot1", 1),
        "release": Release(resource, "bot1", 1),
        "force-release": ForceRelease(resource, "operator"),
    }
    async with _row_guard(admin_pool, resource) as guard:
        task = asyncio.create_task(service.execute(commands[command], CommandContext()))
        blocked_at = await _wait_until_blocked_by(admin_pool, guard)
        assert blocked_at < deadline, "the command was not decided while the lease was live"
        await asyncio.sleep((deadline - blocked_at).total_seconds() + 0.05)
    if command == "force-release":
        outcome = (await task).outcome
        # Decided at the append: the lease had lapsed, so LOCK_EXPIRED. A reaper serving another test in
        # this database may have recorded that expiry first; then there is nothing left to end.
        assert isinstance(outcome, ForceReleased)
        assert outcome.event == LOCK_EXPIRED or outcome.released is False, outcome
    else:
        with pytest.raises(LeaseExpired):
            await task
    async with admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event_type, recorded_at, data ->> 'expires_at' AS expires_at FROM events"
            " WHERE stream_id = $1 ORDER BY stream_version",
            resource,
        )
    types = [r["event_type"] for r in rows]
    # The renew or release itself appends nothing; a reaper serving another test in this database may still
    # record the expiry afterwards, which is the same decision made by someone else.
    expected = [LOCK_ACQUIRED, LOCK_EXPIRED]
    assert types == expected if command == "force-release" else types in (expected[:1], expected)
    for row in rows[1:]:
        assert row["recorded_at"] >= datetime.fromisoformat(row["expires_at"])
