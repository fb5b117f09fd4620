"""``tokens.create_many``: many tokens in one statement, each resolving to its own name, all or nothing."""

from __future__ import annotations

import asyncpg
import pytest

from domain.access import Principal, Role
from service import tokens

pytestmark = pytest.mark.storage


async def test_each_token_resolves_to_its_name_in_order(admin_pool: asyncpg.Pool, unique_prefix: str) -> None:
    names = [f"{unique_prefix}agent-{i}" for i in range(500)]
    async with admin_pool.acquire() as conn:
        issued = await tokens.create_many(conn, names, Role.AGENT)
        assert len(set(issued)) == len(names)
        assert all(tokens.looks_like_a_token(token) for token in issued)
        for index in (0, 1, 499):
            assert await tokens.find(conn, issued[index]) == Principal(names[index], Role.AGENT)
        stored = await conn.fetchval("SELECT count(*) FROM api_tokens WHERE name = ANY($1)", names)
    assert stored == len(names)


async def test_a_name_with_another_role_issues_none(admin_pool: asyncpg.Pool, unique_prefix: str) -> None:
    taken = f"{unique_prefix}boss"
    fresh = f"{unique_prefix}fresh"
    async with admin_pool.acquire() as conn:
        await tokens.create(conn, taken, Role.ADMIN)
        with pytest.raises(tokens.TokenError, match="already has live tokens with role admin"):
            await tokens.create_many(conn, [fresh, taken], Role.AGENT)
        assert await conn.fetchval("SELECT count(*) FROM api_tokens WHERE name = $1", fresh) == 0
        assert len(await tokens.create_many(conn, [taken], Role.ADMIN)) == 1  # same role: a rotation


async def test_bad_names_and_no_names(admin_pool: asyncpg.Pool, unique_prefix: str) -> None:
    async with admin_pool.acquire() as conn:
        with pytest.raises(tokens.TokenError, match="must be 1-200 characters"):
            await tokens.create_many(conn, [f"{unique_prefix}ok", "no spaces"], Role.AGENT)
        assert await conn.fetchval("SELECT count(*) FROM api_tokens WHERE name LIKE $1", "no spaces") == 0
        assert await tokens.create_many(conn, [], Role.AGENT) == []


async def test_a_revoked_name_keeps_its_role(admin_pool: asyncpg.Pool, unique_prefix: str) -> None:
    """Revoking a name's tokens does not free the name for another role (it would own the old
    principal's live leases); the same role may come back, as a rotation."""
    agent = f"{unique_prefix}agv"
    fresh = f"{unique_prefix}fresh"
    async with admin_pool.acquire() as conn:
        await tokens.create(conn, agent, Role.AGENT)
        assert await tokens.revoke(conn, agent) == 1
        expected = f"{agent} had tokens \\(all revoked now\\) with role agent"
        with pytest.raises(tokens.TokenError, match=expected):
            await tokens.create(conn, agent, Role.ADMIN)
        with pytest.raises(tokens.TokenError, match=expected):
            await tokens.create_many(conn, [fresh, agent], Role.DASHBOARD)
        assert await conn.fetchval("SELECT count(*) FROM api_tokens WHERE name = $1", fresh) == 0
        roles = await conn.fetch("SELECT role FROM api_tokens WHERE name = $1", agent)
        assert [row["role"] for row in roles] == ["agent"]
        rotated = await tokens.create(conn, agent, Role.AGENT)
        assert await tokens.find(conn, rotated) == Principal(agent, Role.AGENT)
