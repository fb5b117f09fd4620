"""Shared locks on a real PostgreSQL: the projection rows written with the append, the version check, a
renewal refused once its grant lapsed by the database clock, the queue's rule where the grant is
serialized, the reaper's pass, a rebuild from the log and the migration's downgrade
(docs/decisions/0051-shared-locks.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from alembic import command

from domain.errors import LeaseExpired, NotHolder
from domain.resource import TtlBounds
from domain.shared_lock import (
    AcquireShared,
    LimitMismatch,
    ReleaseShared,
    RenewShared,
    SharedLockHeld,
    SharedQueueAhead,
    decide,
    stream_id,
)
from eventstore.dburl import asyncpg_dsn
from migrations.upgrade import alembic_config
from projections.shared_locks import rebuild_shared_locks
from service.composition import lock_service_on_pool, shared_lock_service_on_pool
from service.lock_service import CommandContext
from service.queue_store import PostgresQueue
from service.shared_lock_service import SharedLockService, expire_shared, plan_of
from service.shared_lock_store import PostgresSharedLockStore

pytestmark = pytest.mark.storage

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)
CTX = CommandContext(principal="tester")


@pytest.fixture
def service_pool(own_service_pool: asyncpg.Pool) -> asyncpg.Pool:
    """The module's own database: no test server's reaper expires its lapsed grants first."""
    return own_service_pool


@pytest.fixture
def admin_pool(own_admin_pool: asyncpg.Pool) -> asyncpg.Pool:
    return own_admin_pool


@pytest.fixture
async def shared(service_pool: asyncpg.Pool) -> AsyncIterator[SharedLockService]:
    locks = lock_service_on_pool(service_pool, BOUNDS)
    yield shared_lock_service_on_pool(service_pool, locks, BOUNDS)
    await locks.close()


async def _holders(admin: asyncpg.Pool, resource: str) -> list[tuple[int, str, str]]:
    rows = await admin.fetch(
        "SELECT fencing_token, owner, mode FROM shared_holders WHERE resource = $1 ORDER BY 1", resource
    )
    return [(row[0], row[1], row[2]) for row in rows]


async def test_grants_are_projected_with_their_events(
    shared: SharedLockService, admin_pool: asyncpg.Pool, resource: str
) -> None:
    first = await shared.execute(AcquireShared(resource, "r1", "shared", 60_000), CTX)
    second = await shared.execute(AcquireShared(resource, "r2", "shared", 60_000), CTX)
    assert (first.outcome["fencing_token"], second.outcome["fencing_token"]) == (1, 2)
    assert await _holders(admin_pool, resource) == [(1, "r1", "shared"), (2, "r2", "shared")]
    with pytest.raises(SharedLockHeld) as held:
        await shared.execute(AcquireShared(resource, "w", "exclusive", 60_000), CTX)
    assert sorted(g.owner for g in held.value.conflicts) == ["r1", "r2"]
    await shared.execute(ReleaseShared(resource, "r1", 1), CTX)
    await shared.execute(ReleaseShared(resource, "r2", 2), CTX)
    writer = await shared.execute(AcquireShared(resource, "w", "exclusive", 60_000), CTX)
    assert writer.outcome["fencing_token"] == 5
    assert await _holders(admin_pool, resource) == [(5, "w", "exclusive")]
    rows = await admin_pool.fetch(
        "SELECT stream_version, event_type, data FROM events WHERE stream_id = $1 ORDER BY 1",
        stream_id(resource),
    )
    assert [row["event_type"] for row in rows] == [
        "SHARED_ACQUIRED", "SHARED_ACQUIRED", "SHARED_RELEASED", "SHARED_RELEASED", "SHARED_ACQUIRED",
    ]  # fmt: skip
    head = await admin_pool.fetchval("SELECT version FROM shared_locks WHERE resource = $1", resource)
    assert head == 5
    # Nothing of the mutex of the same name moved: a shared lock is a lock of its own.
    assert await admin_pool.fetchval("SELECT count(*) FROM lock_state WHERE resource = $1", resource) == 0


async def test_a_stale_plan_writes_nothing(
    shared: SharedLockService, service_pool: asyncpg.Pool, admin_pool: asyncpg.Pool, resource: str
) -> None:
    await shared.execute(AcquireShared(resource, "r1", "shared", 60_000, 2), CTX)
    store = PostgresSharedLockStore(service_pool, 5.0)
    loaded = await store.load(resource, "tester", None)
    plan_source = await shared.execute(AcquireShared(resource, "r2", "shared", 60_000, 2), CTX)
    assert plan_source.outcome["fencing_token"] == 2
    # A plan decided on the state before r2's grant (version 1) is refused by the version check.
    command = AcquireShared(resource, "r3", "shared", 60_000, 2)
    events = decide(loaded.state, command, loaded.db_now, BOUNDS)
    stale = plan_of(command, loaded.state, events, {}, CTX, b"x", None)
    assert await store.commit(stale) is None
    assert [h[1] for h in await _holders(admin_pool, resource)] == ["r1", "r2"]
    with pytest.raises(SharedLockHeld):  # decided again on what the lock is now: full
        await shared.execute(command, CTX)
    with pytest.raises(LimitMismatch):
        await shared.execute(AcquireShared(resource, "r4", "shared", 60_000, 3), CTX)


async def test_a_lapsed_grant_is_neither_renewed_nor_released_and_the_reaper_expires_it(
    shared: SharedLockService, admin_pool: asyncpg.Pool, resource: str
) -> None:
    granted = await shared.execute(AcquireShared(resource, "r1", "shared", 50), CTX)
    token = granted.outcome["fencing_token"]
    with pytest.raises(NotHolder):
        await shared.execute(RenewShared(resource, "r1", token + 1), CTX)
    await asyncio.sleep(0.1)  # the database clock passes the 50 ms deadline
    with pytest.raises(LeaseExpired):
        await shared.execute(RenewShared(resource, "r1", token), CTX)
    assert await _expired_of(shared, admin_pool, resource) == 1
    assert await _holders(admin_pool, resource) == []
    types = await admin_pool.fetch(
        "SELECT event_type FROM events WHERE stream_id = $1 ORDER BY stream_version", stream_id(resource)
    )
    assert [row[0] for row in types] == ["SHARED_ACQUIRED", "SHARED_EXPIRED"]
    with pytest.raises(NotHolder):  # an expired grant is gone
        await shared.execute(ReleaseShared(resource, "r1", token), CTX)


async def _expired_of(shared: SharedLockService, admin: asyncpg.Pool, resource: str) -> int:
    await expire_shared(shared, 1_000)
    return int(
        await admin.fetchval(
            "SELECT count(*) FROM events WHERE stream_id = $1 AND event_type = 'SHARED_EXPIRED'",
            stream_id(resource),
        )
    )


async def test_a_reader_behind_a_queued_writer_waits_where_the_grant_is_serialized(
    shared: SharedLockService, service_pool: asyncpg.Pool, resource: str
) -> None:
    reader = await shared.execute(AcquireShared(resource, "r1", "shared", 60_000), CTX)
    queue = PostgresQueue(service_pool, 5.0, "test")
    ticket = await queue.enter(stream_id(resource), "writer", 60_000, exclusive=True)
    assert ticket is not None
    with pytest.raises(SharedQueueAhead):  # a new reader does not overtake the waiting writer
        await shared.execute(AcquireShared(resource, "r2", "shared", 60_000), CTX)
    await queue.leave(ticket)
    await shared.execute(AcquireShared(resource, "r2", "shared", 60_000), CTX)
    await shared.execute(ReleaseShared(resource, "r1", reader.outcome["fencing_token"]), CTX)


async def test_the_migration_downgrades_and_upgrades_again(scratch_database_url: str) -> None:
    config = alembic_config(scratch_database_url)
    await asyncio.to_thread(command.downgrade, config, "0015")
    conn = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    try:
        tables = await conn.fetchval("SELECT count(*) FROM pg_class WHERE relname LIKE 'shared\\_%'")
        column = await conn.fetchval(
            "SELECT count(*) FROM information_schema.columns"
            " WHERE table_name = 'lock_queue' AND column_name = 'exclusive'"
        )
        assert (tables, column) == (0, 0)
        await asyncio.to_thread(command.upgrade, config, "head")
        assert await conn.fetchval("SELECT count(*) FROM shared_holders") == 0
    finally:
        await conn.close()


async def test_a_rebuild_folds_the_log_into_the_same_rows(
    shared: SharedLockService, admin_pool: asyncpg.Pool, resource: str
) -> None:
    semaphore = f"{resource}-bay"
    for owner in ("a", "b", "c"):
        await shared.execute(AcquireShared(semaphore, owner, "shared", 60_000, 3), CTX)
    await shared.execute(RenewShared(semaphore, "b", 2, 90_000), CTX)
    await shared.execute(ReleaseShared(semaphore, "a", 1), CTX)
    await shared.execute(AcquireShared(resource, "w", "exclusive", 60_000), CTX)
    heads = "SELECT * FROM shared_locks ORDER BY resource"
    grants = "SELECT * FROM shared_holders ORDER BY resource, fencing_token"
    async with admin_pool.acquire() as conn, conn.transaction():
        before = ([tuple(r) for r in await conn.fetch(heads)], [tuple(r) for r in await conn.fetch(grants)])
        locks = await rebuild_shared_locks(conn)
        after = ([tuple(r) for r in await conn.fetch(heads)], [tuple(r) for r in await conn.fetch(grants)])
    assert locks == len(before[0]) >= 2
    assert [row[:3] for row in after[1] if row[0] == semaphore] == [(semaphore, 2, "b"), (semaphore, 3, "c")]
    assert after == before
