"""Borrowing a pooled connection costs the command path no pass through the event loop.

Under load the loop's ready queue holds a burst of other requests, so every task a round trip spawns
delays its answer by that burst: asyncpg's ``acquire(timeout=...)`` (``asyncio.wait_for``) and
``release`` (``asyncio.shield``) each spawn one. ``service.database.connection`` bounds the wait with
``asyncio.timeout`` and returns a healthy connection in the background; a failed one it returns before
the error propagates, so a stalled cancel stays visible to the database guard.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from service.config import Settings
from service.database import connection, create_pool

pytestmark = pytest.mark.storage


async def _idle_after_warm_up(pool: asyncpg.Pool) -> int:
    async with connection(pool, 2.0) as conn:
        await conn.fetchval("SELECT 1")
    for _ in range(3):
        await asyncio.sleep(0)
    return pool.get_idle_size()


async def test_a_loan_never_yields_to_the_event_loop(service_pool: asyncpg.Pool) -> None:
    idle = await _idle_after_warm_up(service_pool)
    assert idle > 0
    other_work: list[str] = []
    asyncio.get_running_loop().call_soon(other_work.append, "ran")
    async with connection(service_pool, 2.0):
        assert other_work == [], "borrowing waited for the event loop"
    assert other_work == [], "returning waited for the event loop"
    assert service_pool.get_idle_size() == idle - 1  # on its way back, not back yet
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert other_work == ["ran"]
    assert service_pool.get_idle_size() == idle


async def test_a_failed_loan_is_returned_before_the_error_propagates(service_pool: asyncpg.Pool) -> None:
    idle = await _idle_after_warm_up(service_pool)
    with pytest.raises(asyncpg.UndefinedTableError):
        async with connection(service_pool, 2.0) as conn:
            await conn.fetchval("SELECT * FROM no_such_table")
    assert service_pool.get_idle_size() == idle


@pytest.fixture
async def one_connection_pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(settings, max_size=1)
    yield pool
    await pool.close()


async def test_a_loan_waits_at_most_its_timeout(one_connection_pool: asyncpg.Pool) -> None:
    pool = one_connection_pool
    async with connection(pool, 2.0):
        with pytest.raises(TimeoutError):
            async with connection(pool, 0.05):
                pytest.fail("the only connection was lent twice")
    async with connection(pool, 0.5) as conn:  # returned in the background, and lent again
        assert await conn.fetchval("SELECT 1") == 1
