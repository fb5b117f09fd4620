"""A reservation's commit on a real PostgreSQL: all or nothing, and no deadlock between overlapping sets.

The all-or-nothing rule is the transaction's, so it is proved where the transaction is: a set with one
plan that cannot stand leaves no trace (no event, no head moved, no Idempotency-Key), and reservations
of overlapping sets, from two services as from two server processes, all finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Sequence

import asyncpg
import pytest

from domain.commands import Acquire
from domain.errors import LockHeld
from domain.reservation import ReleaseReservation, Reserve
from domain.resource import TtlBounds
from service.composition import lock_service_on_pool, reservation_service_on_pool
from service.lock_service import CommandContext, LockService
from service.ports import AppendPlan, Committed
from service.reservation_service import Reservation, ReservationService
from service.reservation_store import PostgresReservationStore

pytestmark = pytest.mark.storage

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)


@pytest.fixture
async def services(service_pool: asyncpg.Pool) -> AsyncIterator[list[tuple[LockService, ReservationService]]]:
    """Two processes' worth of services on one database, each with its own memory and waiters."""
    made = []
    for _ in range(2):
        locks = lock_service_on_pool(service_pool, BOUNDS, wait_poll_s=0.02)
        made.append((locks, reservation_service_on_pool(service_pool, locks, BOUNDS)))
    yield made
    for locks, _ in made:
        await locks.close()


class _StaleOnce:
    """The atomic store, with one plan's expected version made stale on the first commit (as if another
    command moved that stream between the load and the commit); what the log held right after that
    refused commit is kept: events of the set, and rows of the key."""

    def __init__(
        self, inner: PostgresReservationStore, admin: asyncpg.Pool, zones: list[str], key: str
    ) -> None:
        self.inner = inner
        self.admin = admin
        self.zones = zones
        self.key = key
        self.after_refusal: list[int] = []

    async def commit_all(self, plans: Sequence[AppendPlan]) -> list[Committed] | None:
        if not self.after_refusal:
            plans = [
                dataclasses.replace(plan, expected_version=plan.expected_version + 7)
                if plan.new_state.resource == self.zones[-1]
                else plan
                for plan in plans
            ]
        result = await self.inner.commit_all(plans)
        if result is None:
            events = "SELECT count(*) FROM events WHERE stream_id = ANY($1::text[])"
            keys = "SELECT count(*) FROM idempotency_keys WHERE key = $1"
            self.after_refusal = [
                await self.admin.fetchval(events, self.zones),
                await self.admin.fetchval(keys, self.key),
            ]
        return result


async def test_a_plan_that_cannot_stand_rolls_back_the_whole_set(
    service_pool: asyncpg.Pool, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    zones = [f"{unique_prefix}A{n}" for n in range(1, 4)]
    key = f"{unique_prefix}key"
    locks = lock_service_on_pool(service_pool, BOUNDS)
    store = _StaleOnce(PostgresReservationStore(service_pool, 5.0), admin_pool, zones, key)
    service = ReservationService(locks.store, store, BOUNDS, locks.waiters)

    result = await service.execute(
        Reserve("r1", tuple(zones), "agv-1", 30_000), CommandContext(idempotency_key=key)
    )
    await locks.close()

    assert store.after_refusal == [0, 0]  # nothing of the refused set: no event, no key
    assert isinstance(result.outcome, Reservation)
    assert [lease.fencing_token for lease in result.outcome.leases] == [1, 1, 1]  # the retry took all
    rows = await admin_pool.fetch(
        "SELECT stream_id, tx_id::text AS tx FROM events WHERE stream_id = ANY($1::text[])", zones
    )
    assert len(rows) == 3
    assert len({row["tx"] for row in rows}) == 1


async def test_a_refusal_on_a_held_resource_writes_nothing(
    services: list[tuple[LockService, ReservationService]], admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    [(locks, reservations), _] = services
    zones = [f"{unique_prefix}A{n}" for n in range(1, 4)]
    await locks.execute(Acquire(zones[1], "agv-9", 30_000), CommandContext())
    with pytest.raises(LockHeld):
        await reservations.execute(Reserve("r", tuple(zones), "agv-1", 30_000), CommandContext())
    count = await admin_pool.fetchval("SELECT count(*) FROM events WHERE stream_id = ANY($1::text[])", zones)
    assert count == 1  # agv-9's grant only


async def test_overlapping_sets_reserved_at_once_from_two_services_all_finish(
    services: list[tuple[LockService, ReservationService]], admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    zones = [f"{unique_prefix}Z{n}" for n in range(6)]
    rng = random.Random(7)
    holding: dict[str, str] = {}
    violations: list[str] = []

    async def agent(number: int) -> int:
        _, service = services[number % 2]
        done = 0
        for round_ in range(6):
            route = rng.sample(zones, rng.randint(2, 4))  # in any order: the service sorts
            rid = f"{unique_prefix}a{number}r{round_}"
            granted = await service.execute(
                Reserve(rid, tuple(route), f"agv-{number}", 30_000, wait_ms=20_000), CommandContext()
            )
            assert isinstance(granted.outcome, Reservation)
            for zone in route:
                if zone in holding:
                    violations.append(f"{zone} held by {holding[zone]} and {rid}")
                holding[zone] = rid
            await asyncio.sleep(0)
            for zone in route:
                del holding[zone]
            await service.execute(
                ReleaseReservation(rid, f"agv-{number}", granted.outcome.leases), CommandContext()
            )
            done += 1
        return done

    finished = await asyncio.wait_for(asyncio.gather(*(agent(n) for n in range(8))), 120)

    assert finished == [6] * 8
    assert violations == []
    rows = await admin_pool.fetch(
        "SELECT metadata ->> 'reservation_id' AS rid, count(DISTINCT tx_id::text) AS txs, count(*) AS n"
        " FROM events WHERE stream_id = ANY($1::text[]) AND event_type = 'LOCK_ACQUIRED'"
        " GROUP BY 1",
        zones,
    )
    assert len(rows) == 48
    assert all(row["txs"] == 1 for row in rows)  # each reservation's grants: one transaction
