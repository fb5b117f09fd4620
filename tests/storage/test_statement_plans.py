"""The command path's statements stay index probes, whatever the tables held when they were planned.

asyncpg prepares each statement once per connection, and after five executions PostgreSQL keeps a
generic plan for it. A server that starts on an empty database plans while ``lock_state`` is empty and
never analyzed; the planner then takes the table for ten pages, and a join against it looked cheaper as
a sequential scan and a hash. That plan stayed cached while the table grew: in the benchmark every
commit batch read the whole of ``lock_state`` (23,000 rows after a few seconds, 60 % of PostgreSQL's
CPU). Two defences, each tested here on new copies of the tables in both states that invite the scan
(never analyzed, and analyzed while they held three rows):

- the statements reach these tables only by key (``LATERAL`` lookups, ``ON CONFLICT`` on the primary
  key), which is enough while the tables were never analyzed;
- the command path's sessions run with ``enable_seqscan = off`` (``COMMAND_PATH_SETTINGS``): a table
  analyzed while it held a page makes even a per-key lookup look cheaper as a scan of that page.

The Idempotency-Key purge, a DELETE that cannot be written as key lookups, is instead never prepared.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from eventstore.connection import Connection
from projections import shared_locks
from service import lock_store, queue_store, reaper_store
from service.config import Settings
from service.database import COMMAND_PATH_SETTINGS, create_pool

pytestmark = pytest.mark.storage

TABLES = (
    "lock_state",
    "events",
    "idempotency_keys",
    "outage_beacon",
    "lock_queue",
    "shared_locks",
    "shared_holders",
)
STATEMENTS = {
    "load": lock_store.LOAD_SQL,
    "commit": lock_store.COMMIT_SQL,
    "expire_due": reaper_store.EXPIRE_DUE_SQL,
    "queue_enter": queue_store.ENTER_SQL,
    "queue_leave": queue_store.LEAVE_SQL,
    "purge_tickets": reaper_store.PURGE_TICKETS_SQL,
    "shared_load": shared_locks.LOAD_SQL,
    "shared_commit": shared_locks.COMMIT_SQL,
    "shared_due": shared_locks.DUE_SQL,
    "shared_queue_enter": queue_store.ENTER_SHARED_SQL,
}


@pytest.fixture(params=["never analyzed", "analyzed while tiny"])
async def empty_tables(admin_pool: asyncpg.Pool, request: pytest.FixtureRequest) -> AsyncIterator[Connection]:
    """A connection set up as the command path's sessions are, whose search path finds new copies of the
    command tables: never analyzed, or analyzed while they held three rows."""
    schema = f"plans_{uuid.uuid4().hex[:10]}"
    async with admin_pool.acquire() as conn:
        await conn.execute(f"CREATE SCHEMA {schema}")
        try:
            for table in TABLES:
                await conn.execute(f"CREATE TABLE {schema}.{table} (LIKE public.{table} INCLUDING ALL)")
            # public stays on the path for the functions the statements call (lock_queue_ahead), whose
            # own queries then find the new copies first.
            await conn.execute(f"SET search_path = {schema}, public")
            if request.param == "analyzed while tiny":
                await _three_rows_each(conn)
                await conn.execute("ANALYZE")
            for name, setting in COMMAND_PATH_SETTINGS.items():
                await conn.execute(f"SET {name} = {setting}")
            yield conn
        finally:
            for name in ("search_path", "plan_cache_mode", *COMMAND_PATH_SETTINGS):
                await conn.execute(f"RESET {name}")
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")


async def _three_rows_each(conn: Connection) -> None:
    await conn.execute(
        """INSERT INTO lock_state (resource, version, status, owner, fencing_token, ttl_ms, expires_at,
                                   updated_at)
           SELECT 'zone:' || n, 1, 'held', 'agv-' || n, 1, 30000, now(), now() FROM generate_series(1, 3) n"""
    )
    await conn.execute(
        """INSERT INTO events (stream_id, stream_version, event_type, data, hash)
           SELECT 'zone:' || n, 1, 'LOCK_ACQUIRED', '{}', '\\x00' FROM generate_series(1, 3) n"""
    )
    await conn.execute(
        """INSERT INTO idempotency_keys (principal, key, fingerprint, resource, response, created_at)
           SELECT 'agv-' || n, 'key-' || n, '\\x00', 'zone:' || n, '{}', now()
             FROM generate_series(1, 3) n"""
    )


async def test_the_command_path_sessions_prefer_an_index(
    service_pool: asyncpg.Pool, settings: Settings
) -> None:
    """The service role's pool takes the settings; the query side's pool plans as PostgreSQL likes."""
    async with service_pool.acquire() as conn:
        assert await conn.fetchval("SHOW enable_seqscan") == "off"
    read_pool = await create_pool(settings, role=settings.read_database_role, max_size=1)
    try:
        async with read_pool.acquire() as conn:
            assert await conn.fetchval("SHOW enable_seqscan") == "on"
    finally:
        await read_pool.close()


# A plausible value of each parameter type the statements take; arrays (and a batch's JSON document, an
# array of rows) hold 32 of them.
VALUES = {
    "json": "('[' || rtrim(repeat('{}, ', 32), ', ') || ']')",
    "text": "'zone:A3'",
    "bigint": "1",
    "integer": "1",
    "smallint": "1",
    "boolean": "false",
    "timestamp with time zone": "now()",
    "bytea": "'\\x00'::bytea",
    "jsonb": "'{}'::jsonb",
    "uuid": "gen_random_uuid()",
}


def _argument(kind: str) -> str:
    element = kind.removesuffix("[]")
    value = f"{VALUES[element]}::{element}"
    return f"array_fill({value}, ARRAY[32])" if kind.endswith("[]") else value


async def plan(conn: Connection, name: str, sql: str, mode: str) -> str:
    """EXPLAIN of the plan a prepared statement runs on (not executed): the generic plan, or a custom
    plan for a batch of 32 commands (PostgreSQL plans the first five executions with the arguments'
    values, and keeps doing so whenever the generic plan looks dearer)."""
    await conn.execute(f"SET plan_cache_mode = force_{mode}_plan")
    await conn.execute(f"PREPARE {name} AS {sql}")
    try:
        types = await conn.fetchval(
            "SELECT parameter_types::text[] FROM pg_prepared_statements WHERE name = $1", name
        )
        arguments = ", ".join(_argument(kind) for kind in types)
        rows = await conn.fetch(f"EXPLAIN EXECUTE {name}({arguments})")
    finally:
        await conn.execute(f"DEALLOCATE {name}")
    return "\n".join(row[0] for row in rows)


@pytest.mark.parametrize("mode", ["generic", "custom"])
@pytest.mark.parametrize("name", sorted(STATEMENTS))
async def test_no_statement_scans_a_command_table(empty_tables: Connection, name: str, mode: str) -> None:
    explained = await plan(empty_tables, name, STATEMENTS[name], mode)
    assert "Index Scan" in explained or "Conflict Arbiter" in explained, explained  # it reaches the tables
    for table in TABLES:
        assert f"Seq Scan on {table}" not in explained, explained


async def test_the_purge_is_planned_for_the_table_as_it_is(empty_tables: Connection) -> None:
    """The purge is never prepared (its plan is not cached), and on a large table it deletes the old keys
    by row address instead of joining them against a scan of the whole table."""
    conn = empty_tables
    assert await reaper_store.purge_expired(conn, retention_s=3_600, batch=100) == 0
    sent = reaper_store.PURGE_SQL.format(retention_s=3_600, batch=100)
    assert await conn.fetchval("SELECT count(*) FROM pg_prepared_statements WHERE statement = $1", sent) == 0
    await conn.execute(
        """INSERT INTO idempotency_keys (principal, key, fingerprint, resource, response, created_at)
           SELECT 'agent', 'key-' || n, '\\x00', 'zone:A3', '{}', now() - n * interval '1 second'
             FROM generate_series(1, 50000) AS n"""
    )
    sql = reaper_store.PURGE_SQL.format(retention_s=3_600, batch=5_000)
    explained = "\n".join(row[0] for row in await conn.fetch(f"EXPLAIN {sql}"))
    assert "Tid Scan on idempotency_keys" in explained, explained  # the deletion itself, by row address
    assert "Join" not in explained, explained
    assert await reaper_store.purge_expired(conn, retention_s=3_600, batch=5_000) == 5_000


async def test_a_reaper_pass_reads_only_the_leases_that_are_due(empty_tables: Connection) -> None:
    """With thousands of leases held and none due, the expiry statement reads a page or two of the
    deadline index, not every held lease: its scan is bounded by the deadline, and a pass that expires
    nothing touches no row."""
    conn = empty_tables
    await conn.execute("DELETE FROM lock_state")  # the copy's three rows are due
    await conn.execute(
        """INSERT INTO lock_state (resource, version, status, owner, fencing_token, ttl_ms, expires_at,
                                   updated_at)
           SELECT 'zone:' || n, 1, 'held', 'agv-' || n, 1, 30000, now() + interval '30 seconds', now()
             FROM generate_series(1, 5000) n"""
    )
    await conn.execute("ANALYZE lock_state")
    # Run, not only planned: nothing is due, so it writes nothing.
    rows = await conn.fetch(
        f"EXPLAIN (ANALYZE, FORMAT JSON) {reaper_store.EXPIRE_DUE_SQL}", 1_000, "probe", 3_000
    )
    explained = json.loads(rows[0][0])[0]["Plan"]
    scans = [node for node in _nodes(explained) if node.get("Relation Name") == "lock_state"]
    assert scans, explained
    assert all(node.get("Rows Removed by Filter", 0) == 0 for node in scans), scans
    assert sum(node.get("Actual Rows", 0) for node in scans) == 0, scans


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)
