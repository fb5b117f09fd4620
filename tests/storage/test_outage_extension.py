"""After an outage (a gap in the beacon), every lease live when it began is extended by it, once, in the
log; and a process that met the outage extends before it takes anything over.

Each test runs on a database of its own: the beacon and the extension are database-wide.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import asyncpg
import pytest

from domain.commands import Acquire, Release
from domain.errors import DomainError
from domain.saga import StartSaga, StartStep, StepDef
from domain.shared_lock import AcquireShared, RenewShared
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import verify_chains
from service.composition import lock_service_on_pool, saga_service_on_pool, shared_lock_service_on_pool
from service.config import Settings
from service.database import create_pool
from service.database_guard import DatabaseGuard
from service.lock_service import CommandContext, LockService
from service.outage import OutageWatch
from service.reaper_store import due_sagas
from service.saga_service import SagaContext
from tests.assertions import granted

pytestmark = [pytest.mark.storage, pytest.mark.slow]

CTX = CommandContext()
SHORT_MS = 1_000  # the shortest lease the bounds allow
LAPSE_S = 1.3  # long enough for a SHORT_MS lease to lapse


@pytest.fixture
async def admin(scratch_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    yield conn
    await conn.close()


@pytest.fixture
async def pool(scratch_database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(Settings(database_url=scratch_database_url, reaper_enabled=False))
    yield pool
    await pool.close()


def watch_on(pool: asyncpg.Pool, instance: str = "test:1") -> OutageWatch:
    # A tenth of a second between beats, half a second of silence is an outage: the test's pauses count.
    return OutageWatch(pool, instance, interval_ms=100, outage_after_ms=500, timeout_s=10)


def service_on(pool: asyncpg.Pool, watch: OutageWatch | None = None) -> LockService:
    return lock_service_on_pool(pool, Settings().ttl_bounds, outage_watch=watch)


async def beating(watch: OutageWatch, seconds: float) -> None:
    """Beat every tenth of a second for ``seconds``, as a running instance does."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        assert await watch.beat() is None
        await asyncio.sleep(0.1)


async def extensions(admin: asyncpg.Connection, resource: str) -> list[dict[str, Any]]:
    rows = await admin.fetch(
        "SELECT data, metadata FROM events WHERE stream_id = $1 AND metadata->>'command' = 'extend'"
        " ORDER BY position",
        resource,
    )
    return [{"data": json.loads(r["data"]), "metadata": json.loads(r["metadata"])} for r in rows]


async def deadline(admin: asyncpg.Connection, resource: str) -> datetime:
    value = await admin.fetchval("SELECT expires_at FROM lock_state WHERE resource = $1", resource)
    assert isinstance(value, datetime)
    return value


async def test_a_gap_extends_each_lease_live_when_it_began_by_the_gap(
    pool: asyncpg.Pool, admin: asyncpg.Connection
) -> None:
    service = service_on(pool)
    watch = watch_on(pool)
    assert await watch.beat() is None  # the first beat ever: nothing to compare with

    lapsed = granted(await service.execute(Acquire("lapsed-before", "bot-d", SHORT_MS), CTX))
    await beating(watch, LAPSE_S)  # it lapses while the database answers: no outage
    long_lease = granted(await service.execute(Acquire("long", "bot-a", 60_000), CTX))
    short_lease = granted(await service.execute(Acquire("short", "bot-b", SHORT_MS), CTX))
    await service.execute(Acquire("released", "bot-c", 60_000), CTX)
    await service.execute(Release("released", "bot-c", 1), CTX)
    before = {r: await deadline(admin, r) for r in ("long", "short", "lapsed-before")}
    assert await watch.beat() is None  # the last beat before the outage

    await asyncio.sleep(LAPSE_S)  # the outage: no beat, and "short" lapses meanwhile
    outage = await watch.beat()

    assert outage is not None
    assert outage.leases_extended == 2
    gap = outage.ended - outage.began
    for resource, lease in (("long", long_lease), ("short", short_lease)):
        [extension] = await extensions(admin, resource)
        assert extension["data"]["fencing_token"] == lease.fencing_token  # the holder keeps its token
        assert extension["metadata"]["reason"] == "outage"
        assert datetime.fromisoformat(extension["metadata"]["outage_from"]) == outage.began
        assert await deadline(admin, resource) == before[resource] + gap
    assert await extensions(admin, "released") == []
    assert await extensions(admin, "lapsed-before") == []
    assert await deadline(admin, "lapsed-before") == before["lapsed-before"]

    # The extended lease is live again: taken by nobody else; the lease that lapsed before is free.
    with pytest.raises(DomainError) as refused:
        await service.execute(Acquire("short", "bot-x", SHORT_MS), CTX)
    assert refused.value.code == "lock_held"
    taken = granted(await service.execute(Acquire("lapsed-before", "bot-x", SHORT_MS), CTX))
    assert taken.fencing_token > lapsed.fencing_token

    assert await watch.beat() is None  # no gap now: nothing extended twice
    assert len(await extensions(admin, "long")) == 1
    report = await verify_chains(admin)
    assert report.ok, report.broken


async def test_instances_beating_together_after_an_outage_extend_once(
    pool: asyncpg.Pool, admin: asyncpg.Connection
) -> None:
    service = service_on(pool)
    watches = [watch_on(pool, f"test:{i}") for i in range(4)]
    await watches[0].beat()
    resources = [f"zone-{i}" for i in range(20)]
    for resource in resources:
        await service.execute(Acquire(resource, "bot", 60_000), CTX)
    await watches[0].beat()
    await asyncio.sleep(LAPSE_S)

    outages = await asyncio.gather(*(watch.beat() for watch in watches))

    assert [o.leases_extended for o in outages if o is not None] == [len(resources)]
    for resource in resources:
        assert len(await extensions(admin, resource)) == 1


async def test_a_process_that_met_an_outage_extends_before_it_takes_a_lease_over(
    pool: asyncpg.Pool, admin: asyncpg.Connection
) -> None:
    watch = watch_on(pool)
    plain = service_on(pool)
    guarded = service_on(pool, watch)
    control = granted(await plain.execute(Acquire("control", "bot-1", SHORT_MS), CTX))
    await guarded.execute(Acquire("guarded", "bot-1", SHORT_MS), CTX)  # a new process: beats first
    await watch.beat()  # the last beat before the outage
    await asyncio.sleep(LAPSE_S)  # both leases lapse; no beat meanwhile
    watch.saw_failure(ConnectionResetError())  # what a round trip during the outage leaves behind

    # Without the watch a lapsed lease is taken over at once (what the rule prevents) ...
    taken = granted(await plain.execute(Acquire("control", "bot-2", SHORT_MS), CTX))
    assert taken.fencing_token > control.fencing_token
    # ... with it the outage's extension comes first, and the holder still holds.
    with pytest.raises(DomainError) as refused:
        await guarded.execute(Acquire("guarded", "bot-2", SHORT_MS), CTX)
    assert refused.value.code == "lock_held"
    assert len(await extensions(admin, "guarded")) == 1


async def test_a_gap_gives_each_saga_live_when_it_began_a_new_lease_and_none_lapses(
    pool: asyncpg.Pool, admin: asyncpg.Connection
) -> None:
    """A saga's own lease is a lease too: the orchestrator could not heartbeat during the outage, so the
    saga lease live when it began starts again after it, and the reaper's saga pass finds nothing due;
    a saga whose lease had already lapsed before the outage is not extended, and its lapse stays."""
    sagas = saga_service_on_pool(pool, DatabaseGuard())
    watch = watch_on(pool)
    assert await watch.beat() is None
    steps = (StepDef("pick", ()),)
    await sagas.execute(StartSaga("lapsed-before", "move", "agv-1", steps, lease_ms=SHORT_MS), SagaContext())
    await beating(watch, LAPSE_S)  # its lease runs out while the database answers: no outage
    await sagas.execute(StartSaga("orphan", "move", "agv-2", steps, lease_ms=SHORT_MS), SagaContext())
    await sagas.execute(StartStep("orphan", "pick"), SagaContext())
    assert await watch.beat() is None  # the last beat before the outage

    await asyncio.sleep(LAPSE_S)  # the outage: no beat, no heartbeat, and "orphan"'s deadline passes
    outage = await watch.beat()

    assert outage is not None
    assert outage.saga_leases_extended == 1
    row = await admin.fetchrow("SELECT status, lease_expires_at FROM saga_state WHERE saga_id = 'orphan'")
    assert row is not None
    assert row["status"] == "running"
    assert row["lease_expires_at"] > outage.ended  # a whole lease from the end of the outage
    metadata = json.loads(
        await admin.fetchval(
            "SELECT metadata FROM events WHERE stream_id = 'saga/orphan'"
            " AND event_type = 'SAGA_LEASE_EXTENDED'"
        )
    )
    assert metadata["reason"] == "outage"
    assert [due.saga_id for due in await due_sagas(admin, 100)] == ["lapsed-before"]
    report = await verify_chains(admin)
    assert report.ok, report.broken


async def test_a_gap_extends_each_shared_grant_live_when_it_began(
    pool: asyncpg.Pool, admin: asyncpg.Connection
) -> None:
    """Shared locks' grants are extended as mutex leases are: one SHARED_RENEWED per live grant, at the
    lock's next versions in token order, the holders keeping their tokens."""
    locks = service_on(pool)
    shared = shared_lock_service_on_pool(pool, locks, Settings().ttl_bounds)
    watch = watch_on(pool)
    assert await watch.beat() is None
    readers = [
        (await shared.execute(AcquireShared("bay", owner, "shared", SHORT_MS, 3), CTX)).outcome
        for owner in ("agv-1", "agv-2")
    ]
    assert await watch.beat() is None  # the last beat before the outage

    await asyncio.sleep(LAPSE_S)  # the outage: both grants lapse meanwhile
    outage = await watch.beat()

    assert outage is not None
    assert outage.shared_grants_extended == 2
    rows = await admin.fetch(
        "SELECT stream_version, data FROM events WHERE stream_id = 'shared/bay'"
        " AND metadata->>'command' = 'extend' ORDER BY stream_version"
    )
    assert [(r["stream_version"], json.loads(r["data"])["fencing_token"]) for r in rows] == [(3, 1), (4, 2)]
    held = await admin.fetch("SELECT fencing_token, expires_at FROM shared_holders ORDER BY 1")
    gap = outage.ended - outage.began
    for reader, row in zip(readers, held, strict=True):
        assert row["expires_at"] == datetime.fromisoformat(reader["expires_at"]) + gap
    # The grants are live again: renewed by their holders, and the lock is at its new version.
    renewed = await shared.execute(RenewShared("bay", "agv-1", 1), CTX)
    assert renewed.changed
    report = await verify_chains(admin)
    assert report.ok, report.broken
    await locks.close()
