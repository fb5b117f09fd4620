"""The token cache: a known token costs no round trip, and a revocation reaches it within one poll."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from domain.access import Principal, Role
from service import tokens
from service.authenticator import Authenticator
from service.config import Settings
from service.database import create_pool
from service.database_guard import DatabaseGuard

pytestmark = pytest.mark.storage


async def test_a_known_token_is_answered_without_the_database(
    settings: Settings, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    async with admin_pool.acquire() as conn:
        token = await tokens.create(conn, f"{unique_prefix}cached", Role.AGENT)
    pool = await create_pool(settings)
    authenticator = Authenticator(pool, DatabaseGuard(), poll_s=60)
    assert await authenticator.authenticate(token) == Principal(f"{unique_prefix}cached", Role.AGENT)
    await pool.close()  # any round trip from here on would fail
    for _ in range(100):
        assert await authenticator.authenticate(token) == Principal(f"{unique_prefix}cached", Role.AGENT)


async def test_a_revoked_token_is_refused_after_the_next_poll(
    service_pool: asyncpg.Pool, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    name = f"{unique_prefix}revoked"
    async with admin_pool.acquire() as conn:
        token = await tokens.create(conn, name, Role.DASHBOARD)
        other = await tokens.create(conn, f"{unique_prefix}kept", Role.DASHBOARD)
    authenticator = Authenticator(service_pool, DatabaseGuard(), poll_s=0.3)
    assert await authenticator.authenticate(token) is not None
    assert await authenticator.authenticate(other) is not None
    async with admin_pool.acquire() as conn:
        assert await tokens.revoke(conn, name) == 1
    await asyncio.sleep(0.4)
    # Many requests arrive when the poll is due: they share one query, and all see the revocation.
    results = await asyncio.gather(*(authenticator.authenticate(token) for _ in range(20)))
    assert results == [None] * 20
    assert await authenticator.authenticate(other) == Principal(f"{unique_prefix}kept", Role.DASHBOARD)


async def test_garbage_and_unknown_tokens_are_refused(service_pool: asyncpg.Pool) -> None:
    authenticator = Authenticator(service_pool, DatabaseGuard())
    for junk in ["", "Bearer", "llt_short", "x" * 60, "llt_" + "é" * 43, "llt_" + "A" * 43]:
        assert await authenticator.authenticate(junk) is None
