"""The event store's invariants, enforced by PostgreSQL itself (DESIGN.md, "Event store invariants").

Anything here that might change the events table runs inside a transaction that is always rolled back, so
a regression (a trigger that stopped refusing) fails the test without damaging the shared log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import datetime, timedelta

import asyncpg
import pytest

from domain.commands import Acquire, Release
from domain.resource import TtlBounds
from eventstore.verify import VerifyReport, event_hash, verify_chains
from service.composition import lock_service_on_pool
from service.lock_service import CommandContext, LockService

pytestmark = pytest.mark.storage


class _Rollback(Exception):
    """Raised at the end of a transaction block to undo whatever it did."""


async def _attempt(conn: asyncpg.pool.PoolConnectionProxy, statement: str, *args: object) -> Exception:
    """Run ``statement`` in a transaction that is rolled back whatever happens; the error it raised."""
    try:
        async with conn.transaction():
            await conn.execute(statement, *args)
            raise _Rollback
    except asyncpg.PostgresError as error:
        return error
    except _Rollback as allowed:
        return allowed


async def _tampered(conn: asyncpg.pool.PoolConnectionProxy, statement: str, resource: str) -> VerifyReport:
    """Tamper with the log and verify it, on one connection in one transaction that is then rolled back.

    verify_chains opens a repeatable-read transaction; nested in one of the same level it is a savepoint,
    so it sees the tampered rows, and the final rollback undoes the tamper and the trigger switch alike.
    """
    report: VerifyReport | None = None
    with contextlib.suppress(_Rollback):
        async with conn.transaction(isolation="repeatable_read"):
            await conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
            assert await conn.execute(statement, resource) == "UPDATE 1"
            report = await verify_chains(conn)
            raise _Rollback
    assert report is not None
    return report


async def _stream(lock_service: LockService, resource: str) -> None:
    """A stream of three events: acquire, release, acquire."""
    await lock_service.execute(Acquire(resource, "bot1", 30_000), CommandContext())
    await lock_service.execute(Release(resource, "bot1", 1), CommandContext())
    await lock_service.execute(Acquire(resource, "bot2", 30_000), CommandContext())


async def _event_rows(pool: asyncpg.Pool, resource: str) -> list[asyncpg.Record]:
    async with pool.acquire() as conn:
        return await conn.fetch(
            "SELECT position, stream_version, event_id, event_type, data::text AS data, recorded_at,"
            " tx_id::text AS tx_id, hash FROM events WHERE stream_id = $1 ORDER BY stream_version",
            resource,
        )


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET event_type = event_type WHERE stream_id = $1",
        "DELETE FROM events WHERE stream_id = $1",
    ],
)
async def test_service_role_may_not_update_or_delete(
    service_pool: asyncpg.Pool, lock_service: LockService, resource: str, statement: str
) -> None:
    await _stream(lock_service, resource)
    async with service_pool.acquire() as conn:
        assert await conn.fetchval("SELECT current_user") == "lockledger_service"
        error = await _attempt(conn, statement, resource)
    assert isinstance(error, asyncpg.InsufficientPrivilegeError)
    assert "permission denied for table events" in str(error)
    assert len(await _event_rows(service_pool, resource)) == 3


async def test_service_role_may_not_truncate(service_pool: asyncpg.Pool) -> None:
    async with service_pool.acquire() as conn:
        error = await _attempt(conn, "TRUNCATE events")
    assert isinstance(error, asyncpg.InsufficientPrivilegeError)
    assert "permission denied for table events" in str(error)


async def test_service_role_holds_only_insert_and_select_on_events(admin_pool: asyncpg.Pool) -> None:
    async with admin_pool.acquire() as conn:
        privileges = await conn.fetch(
            "SELECT privilege_type FROM information_schema.role_table_grants"
            " WHERE grantee = 'lockledger_service' AND table_name = 'events'"
        )
    assert sorted(row["privilege_type"] for row in privileges) == ["INSERT", "SELECT"]


@pytest.mark.parametrize(
    ("statement", "operation"),
    [
        ("UPDATE events SET data = data || '{\"x\": 1}' WHERE stream_id = $1", "UPDATE"),
        ("DELETE FROM events WHERE stream_id = $1", "DELETE"),
        # Statement-level trigger: even a DELETE that matches no row is refused.
        ("DELETE FROM events WHERE stream_id = $1 AND false", "DELETE"),
    ],
)
async def test_owner_update_and_delete_are_refused_by_trigger(
    admin_pool: asyncpg.Pool, lock_service: LockService, resource: str, statement: str, operation: str
) -> None:
    await _stream(lock_service, resource)
    before = await _event_rows(admin_pool, resource)
    async with admin_pool.acquire() as conn:
        error = await _attempt(conn, statement, resource)
    assert isinstance(error, asyncpg.PostgresError)
    assert f"append-only: {operation} refused" in str(error)
    assert await _event_rows(admin_pool, resource) == before


async def test_owner_truncate_is_refused_by_trigger(
    admin_pool: asyncpg.Pool, lock_service: LockService, resource: str
) -> None:
    await _stream(lock_service, resource)
    async with admin_pool.acquire() as conn:
        count = await conn.fetchval("SELECT count(*) FROM events")
        error = await _attempt(conn, "TRUNCATE events")
        assert isinstance(error, asyncpg.PostgresError)
        assert "append-only: TRUNCATE refused" in str(error)
        assert await conn.fetchval("SELECT count(*) FROM events") >= count


async def test_stream_version_is_unique(
    admin_pool: asyncpg.Pool, lock_service: LockService, resource: str
) -> None:
    await _stream(lock_service, resource)
    async with admin_pool.acquire() as conn:
        error = await _attempt(
            conn,
            "INSERT INTO events (stream_id, stream_version, event_type, data)"
            " VALUES ($1, 2, 'LOCK_RELEASED', '{}'::jsonb)",
            resource,
        )
    assert isinstance(error, asyncpg.UniqueViolationError)
    assert error.constraint_name == "events_stream_version_key"


async def test_event_id_is_unique(admin_pool: asyncpg.Pool, lock_service: LockService, resource: str) -> None:
    """Unique with recorded_at, as a partitioned table's unique indexes must be: the ids are version-7
    UUIDs, which carry the millisecond they were made in (docs/decisions/0044-time-partitioned-events.md)."""
    await _stream(lock_service, resource)
    rows = await _event_rows(admin_pool, resource)
    async with admin_pool.acquire() as conn:
        # The next version of the stream (so the chain trigger accepts it) with a reused event id.
        error = await _attempt(
            conn,
            "INSERT INTO events (stream_id, stream_version, event_id, event_type, data, recorded_at)"
            " VALUES ($1, 4, $2, 'LOCK_RELEASED', '{}'::jsonb, $3)",
            resource,
            rows[0]["event_id"],
            rows[0]["recorded_at"],
        )
        assert isinstance(error, asyncpg.UniqueViolationError)
        # The partition's index, a part of the parent's events_event_id_key.
        parent = await conn.fetchval(
            "SELECT inhparent::regclass::text FROM pg_inherits WHERE inhrelid = to_regclass($1)",
            error.constraint_name,
        )
    assert parent == "events_event_id_key"


async def test_recorded_at_is_the_database_clock_at_the_append(
    admin_pool: asyncpg.Pool, lock_service: LockService, resource: str
) -> None:
    async with admin_pool.acquire() as conn:
        before = await conn.fetchval("SELECT clock_timestamp()")
        await lock_service.execute(Acquire(resource, "bot1", 12_345), CommandContext())
        after = await conn.fetchval("SELECT clock_timestamp()")
        row = await conn.fetchrow(
            "SELECT e.recorded_at, e.data ->> 'expires_at' AS expires_at, s.updated_at, s.acquired_at"
            "  FROM events e JOIN lock_state s ON s.resource = e.stream_id"
            " WHERE e.stream_id = $1 AND e.stream_version = 1",
            resource,
        )
    assert row is not None
    assert before <= row["recorded_at"] <= after
    # The deadline is computed from that very instant, and the projection carries it too.
    assert datetime.fromisoformat(row["expires_at"]) - row["recorded_at"] == timedelta(milliseconds=12_345)
    assert row["updated_at"] == row["recorded_at"] == row["acquired_at"]


async def test_recorded_at_default_is_clock_timestamp_not_transaction_start(
    admin_pool: asyncpg.Pool, lock_service: LockService, resource: str
) -> None:
    await _stream(lock_service, resource)
    row: asyncpg.Record | None = None
    async with admin_pool.acquire() as conn:
        with contextlib.suppress(_Rollback):
            async with conn.transaction():
                await conn.execute("SELECT pg_sleep(0.05)")
                row = await conn.fetchrow(
                    "INSERT INTO events (stream_id, stream_version, event_type, data)"
                    " VALUES ($1, 4, 'LOCK_RELEASED', '{}'::jsonb)"
                    " RETURNING recorded_at, now() AS started, tx_id::text AS tx_id,"
                    " pg_current_xact_id()::text AS current",
                    resource,
                )
                raise _Rollback
    assert row is not None
    assert row["recorded_at"] - row["started"] >= timedelta(milliseconds=50)
    assert row["tx_id"] == row["current"]
    assert len(await _event_rows(admin_pool, resource)) == 3


async def test_tx_id_is_the_writing_transaction(
    service_pool: asyncpg.Pool, admin_pool: asyncpg.Pool, resource: str
) -> None:
    service = lock_service_on_pool(service_pool, TtlBounds(min_ms=10, max_ms=60_000, default_ms=30_000))
    await service.execute(Acquire(resource, "bot1", 100), CommandContext())
    # Keep reapers off the lapsing lease (they skip locked rows), so the next acquire finds it lapsed and
    # expires and re-acquires it in one statement: two events, one transaction.
    async with admin_pool.acquire() as guard, guard.transaction():
        await guard.execute("SELECT FROM lock_state WHERE resource = $1 FOR KEY SHARE", resource)
        await asyncio.sleep(0.15)
        acquire = asyncio.create_task(service.execute(Acquire(resource, "bot2", 30_000), CommandContext()))
        await asyncio.sleep(0.05)
    await acquire
    async with admin_pool.acquire() as conn:
        assert await conn.fetchval("SELECT pg_typeof(tx_id)::text FROM events LIMIT 1") == "xid8"
        assert await conn.fetchval("SELECT count(*) FROM events WHERE tx_id IS NULL") == 0
    rows = await _event_rows(admin_pool, resource)
    assert [r["event_type"] for r in rows] == ["LOCK_ACQUIRED", "LOCK_EXPIRED", "LOCK_ACQUIRED"]
    assert rows[1]["tx_id"] == rows[2]["tx_id"] != rows[0]["tx_id"]
    assert int(rows[0]["tx_id"]) < int(rows[1]["tx_id"])
    assert rows[0]["position"] < rows[1]["position"] < rows[2]["position"]
    assert rows[1]["recorded_at"] == rows[2]["recorded_at"]


async def test_hash_chain_detects_tampering(
    admin_pool: asyncpg.Pool, lock_service: LockService, resource: str
) -> None:
    await _stream(lock_service, resource)
    before = await _event_rows(admin_pool, resource)
    async with admin_pool.acquire() as conn:
        report = await verify_chains(conn)
        assert report.ok, report.broken
        assert report.events >= 3
        broken = await _tampered(
            conn,
            "UPDATE events SET data = jsonb_set(data, '{owner}', '\"mallory\"')"
            " WHERE stream_id = $1 AND stream_version = 2",
            resource,
        )
        assert broken.broken is not None
        assert (broken.broken.stream_id, broken.broken.version) == (resource, 2)
        assert "hash" in broken.broken.reason
        # Rolled back: the trigger is on again and the event is as it was.
        assert (
            await conn.fetchval("SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'events_append_only'")
            == "O"
        )
        assert (await verify_chains(conn)).ok
    after = await _event_rows(admin_pool, resource)
    assert after == before
    assert json.loads(after[1]["data"])["owner"] == "bot1"


async def test_hash_chain_links_each_event_to_its_predecessor(
    admin_pool: asyncpg.Pool, lock_service: LockService, resource: str
) -> None:
    """A forger who rewrites an event and recomputes its own hash is still caught, at the next event."""
    await _stream(lock_service, resource)
    report: VerifyReport | None = None
    async with admin_pool.acquire() as conn:
        with contextlib.suppress(_Rollback):
            async with conn.transaction(isolation="repeatable_read"):
                await conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
                row = await conn.fetchrow(
                    "UPDATE events SET data = jsonb_set(data, '{owner}', '\"mallory\"')"
                    " WHERE stream_id = $1 AND stream_version = 1"
                    " RETURNING event_id::text AS event_id, event_type, data::text AS data,"
                    " metadata::text AS metadata, recorded_at",
                    resource,
                )
                assert row is not None
                forged = event_hash(
                    b"",
                    resource,
                    1,
                    row["event_id"],
                    row["event_type"],
                    row["data"],
                    row["metadata"],
                    row["recorded_at"],
                )
                await conn.execute(
                    "UPDATE events SET hash = $2 WHERE stream_id = $1 AND stream_version = 1",
                    resource,
                    forged,
                )
                report = await verify_chains(conn)
                raise _Rollback
    assert report is not None
    assert report.broken is not None
    # Version 1 is self-consistent now; version 2 still chains to its original hash.
    assert (report.broken.stream_id, report.broken.version) == (resource, 2)


async def test_verify_names_an_event_whose_stored_hash_was_replaced(
    admin_pool: asyncpg.Pool, lock_service: LockService, resource: str
) -> None:
    await _stream(lock_service, resource)
    async with admin_pool.acquire() as conn:
        broken = await _tampered(
            conn,
            "UPDATE events SET hash = sha256('forged'::bytea) WHERE stream_id = $1 AND stream_version = 3",
            resource,
        )
    assert broken.broken is not None
    assert (broken.broken.stream_id, broken.broken.version) == (resource, 3)
