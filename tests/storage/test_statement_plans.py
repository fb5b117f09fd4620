"""The command path's statements stay index probes, whatever the tables held when they were planned.

asyncpg prepares each statement once per connection, and after five executions PostgreSQL keeps a
generic plan for it. A server that starts on an empty database plans while ``lock_state`` is empty and
never analyzed; the planner then takes the table for ten pages, and a join against it looked cheaper as
a sequential scan and a hash. That plan stayed cached while the table grew: in the benchmark every
commit batch read the whole of ``lock_state`` (23,000 rows after a few seconds, 60 % of PostgreSQL's
CPU). The statements now reach these tables only by key (``LATERAL`` lookups, ``ON CONFLICT`` on the
primary key), so no plan has a sequential scan to choose. This test plans them generically on new, empty,
never analyzed copies of the tables, the state in which the old statements chose the scan. The
Idempotency-Key purge, a DELETE that cannot be written as key lookups, is instead never prepared.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from eventstore.connection import Connection
from service import idempotency, lock_store, reaper

pytestmark = pytest.mark.storage

TABLES = ("lock_state", "events", "idempotency_keys")
STATEMENTS = {
    "load": lock_store.LOAD_SQL,
    "load_many": lock_store.LOAD_MANY_SQL,
    "commit_new": lock_store.COMMIT_NEW_SQL,
    "commit_existing": lock_store.COMMIT_EXISTING_SQL,
    "commit_many": lock_store.COMMIT_MANY_SQL,
    "expire_due": reaper.EXPIRE_DUE_SQL,
}


@pytest.fixture
async def empty_tables(admin_pool: asyncpg.Pool) -> AsyncIterator[Connection]:
    """A connection whose search path finds new, empty, never analyzed copies of the command tables."""
    schema = f"plans_{uuid.uuid4().hex[:10]}"
    async with admin_pool.acquire() as conn:
        await conn.execute(f"CREATE SCHEMA {schema}")
        try:
            for table in TABLES:
                await conn.execute(f"CREATE TABLE {schema}.{table} (LIKE public.{table} INCLUDING ALL)")
            await conn.execute(f"SET search_path = {schema}")
            yield conn
        finally:
            await conn.execute("RESET search_path")
            await conn.execute("RESET plan_cache_mode")
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")


# A plausible value of each parameter type the statements take; arrays hold 32 of them.
VALUES = {
    "text": "'zone:A3'",
    "bigint": "1",
    "integer": "1",
    "smallint": "1",
    "boolean": "false",
    "timestamp with time zone": "now()",
    "bytea": "'\\x00'::bytea",
    "jsonb": "'{}'::jsonb",
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
    assert await idempotency.purge_expired(conn, retention_s=3_600, batch=100) == 0
    prepared = await conn.fetchval(
        "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE $1",
        "%DELETE FROM idempotency_keys%",
    )
    assert prepared == 0
    await conn.execute(
        """INSERT INTO idempotency_keys (principal, key, fingerprint, resource, status_code, response,
                                         created_at)
           SELECT 'agent', 'key-' || n, '\\x00', 'zone:A3', 200, '{}', now() - n * interval '1 second'
             FROM generate_series(1, 50000) AS n"""
    )
    sql = idempotency.PURGE_SQL.format(retention_s=3_600, batch=5_000)
    explained = "\n".join(row[0] for row in await conn.fetch(f"EXPLAIN {sql}"))
    assert "Tid Scan on idempotency_keys" in explained, explained  # the deletion itself, by row address
    assert "Join" not in explained, explained
    assert await idempotency.purge_expired(conn, retention_s=3_600, batch=5_000) == 5_000
