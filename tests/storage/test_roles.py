"""Least privilege in the database: each role can do what its work needs and is refused the rest."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from service.config import Settings
from service.database import create_pool

pytestmark = pytest.mark.storage

REFUSED_FOR_SERVICE = [
    "UPDATE events SET data = data",
    "DELETE FROM events",
    "TRUNCATE events",
    "DELETE FROM lock_state",
    "TRUNCATE lock_state",
    "UPDATE idempotency_keys SET response = response",
    "TRUNCATE idempotency_keys",
    "DROP TABLE events",
    "ALTER TABLE events DISABLE TRIGGER events_append_only",
    "CREATE TABLE sneaky (x int)",
]

REFUSED_FOR_READONLY = [
    "INSERT INTO events (stream_id, stream_version, event_type, data) VALUES ('x', 1, 'X', '{}')",
    "UPDATE lock_state SET owner = 'x'",
    "DELETE FROM lock_state",
    "SELECT * FROM idempotency_keys",  # stored responses are the service's business, not a dashboard's
]


@pytest.mark.parametrize("statement", REFUSED_FOR_SERVICE)
async def test_the_service_role_cannot_rewrite_history_or_the_schema(
    service_pool: asyncpg.Pool, statement: str
) -> None:
    async with service_pool.acquire() as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            async with conn.transaction():
                await conn.execute(statement)


async def test_the_service_role_can_do_its_work(service_pool: asyncpg.Pool) -> None:
    async with service_pool.acquire() as conn:
        assert await conn.fetchval("SELECT current_user") == "lockledger_service"
        await conn.fetchval("SELECT count(*) FROM events")
        await conn.fetchval("SELECT count(*) FROM lock_state")
        await conn.fetchval("SELECT count(*) FROM idempotency_keys")


@pytest.fixture(scope="module")
async def readonly_pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(settings, role="lockledger_readonly")
    yield pool
    await pool.close()


@pytest.mark.parametrize("statement", REFUSED_FOR_READONLY)
async def test_the_readonly_role_only_reads_the_log_and_the_projection(
    readonly_pool: asyncpg.Pool, statement: str
) -> None:
    async with readonly_pool.acquire() as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            async with conn.transaction():
                await conn.execute(statement)


async def test_the_readonly_role_serves_queries_and_replay(readonly_pool: asyncpg.Pool) -> None:
    async with readonly_pool.acquire() as conn:
        assert await conn.fetchval("SELECT current_user") == "lockledger_readonly"
        await conn.fetchval("SELECT count(*) FROM events")
        await conn.fetchval("SELECT count(*) FROM lock_state")
