"""The test databases: which PostgreSQL server the run uses, and scratch databases of a test's own."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg

from eventstore.dburl import asyncpg_dsn
from migrations.upgrade import upgrade
from projections.projector import Projector

TEST_DATABASE_URL_ENV = "LOCKLEDGER_TEST_DATABASE_URL"


@dataclass
class TestDatabase:
    __test__ = False  # a fixture value, not a test class
    url: str
    postgres_pid: int | None  # the embedded server's postmaster, for fault tests; None for an external one


def replace_database(url: str, database: str) -> str:
    """The same server URL pointing at another database (handles ``?host=`` socket URLs)."""
    head, sep, query = url.partition("?")
    scheme_host, _, _ = head.rpartition("/")
    return f"{scheme_host}/{database}{sep}{query}"


def run_admin(url: str, sql: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


@contextlib.contextmanager
def scratch_database(database_url: str) -> Iterator[str]:
    """A migrated database of its own on the test server, dropped when the block ends."""
    name = f"lockledger_scratch_{uuid.uuid4().hex[:8]}"
    run_admin(database_url, f'CREATE DATABASE "{name}"')
    url = replace_database(database_url, name)
    upgrade(url)
    try:
        yield url
    finally:
        run_admin(database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def catch_up_past_writes(conn: asyncpg.Connection, projector: Projector, attempts: int = 200) -> None:
    """Run ``projector`` until it has applied every transaction committed before this call. A projector
    reads windows below the server's xmin, and on a shared server a transaction of another database can
    hold that back: one ``catch_up`` may then end before writes just made."""
    written: int = await conn.fetchval("SELECT pg_current_xact_id()::text::bigint")
    for _ in range(attempts):
        await projector.catch_up(conn)
        if projector.checkpoint is not None and projector.checkpoint.lo > written:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{projector.table} did not pass transaction {written}")
