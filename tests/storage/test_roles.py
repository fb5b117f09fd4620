"""Least privilege in the database: each role can do what its work needs and is refused the rest."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from domain.access import Role
from eventstore.dburl import asyncpg_dsn
from service import tokens
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
    # Tokens: the service mints and revokes them for admins, but never rewrites or deletes one.
    "UPDATE api_tokens SET role = 'admin'",
    "UPDATE api_tokens SET token_hash = token_hash",
    "DELETE FROM api_tokens",
    "TRUNCATE api_tokens",
    # Only the migrator owns the schema.
    "ALTER TABLE api_tokens DROP CONSTRAINT api_tokens_role_check",
]

REFUSED_FOR_READONLY = [
    "INSERT INTO events (stream_id, stream_version, event_type, data) VALUES ('x', 1, 'X', '{}')",
    "UPDATE lock_state SET owner = 'x'",
    "DELETE FROM lock_state",
    "SELECT * FROM idempotency_keys",  # stored responses are the service's business, not a dashboard's
    "SELECT * FROM api_tokens",
]


async def assert_refused(pool: asyncpg.Pool, statement: str) -> None:
    async with pool.acquire() as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            async with conn.transaction():
                await conn.execute(statement)


@pytest.mark.parametrize("statement", REFUSED_FOR_SERVICE)
async def test_the_service_role_cannot_rewrite_history_or_the_schema(
    service_pool: asyncpg.Pool, statement: str
) -> None:
    await assert_refused(service_pool, statement)


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
    await assert_refused(readonly_pool, statement)


async def test_the_readonly_role_serves_queries_and_replay(readonly_pool: asyncpg.Pool) -> None:
    async with readonly_pool.acquire() as conn:
        assert await conn.fetchval("SELECT current_user") == "lockledger_readonly"
        await conn.fetchval("SELECT count(*) FROM events")
        await conn.fetchval("SELECT count(*) FROM lock_state")


OWNED_BY_THE_MIGRATOR = [
    "events",
    "events_default",
    "stream_heads",
    "lock_state",
    "idempotency_keys",
    "api_tokens",
    "alembic_version",
]


async def test_the_migrator_role_owns_the_schema(admin_pool: asyncpg.Pool) -> None:
    """The owner of a table can disable its triggers; no role the service or a reader runs as owns one."""
    async with admin_pool.acquire() as conn:
        tables = {
            r["relname"]: r["owner"]
            for r in await conn.fetch(
                "SELECT c.relname, pg_get_userbyid(c.relowner) AS owner FROM pg_class c"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'S')"
            )
        }
        functions = {
            r["proname"]: r["owner"]
            for r in await conn.fetch(
                "SELECT p.proname, pg_get_userbyid(p.proowner) AS owner FROM pg_proc p"
                " WHERE p.proname IN"
                " ('events_chain_hash', 'events_refuse_change', 'api_tokens_revocation_is_final',"
                "  'events_create_partitions')"
            )
        }
        memberships = await conn.fetch(
            "SELECT r.rolname FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.roleid"
            " JOIN pg_roles u ON u.oid = m.member"
            " WHERE u.rolname IN ('lockledger_service', 'lockledger_readonly')"
        )
    assert {t: tables[t] for t in OWNED_BY_THE_MIGRATOR} == dict.fromkeys(
        OWNED_BY_THE_MIGRATOR, "lockledger_migrator"
    )
    # Every partition of events, the ones the service's events_create_partitions made too.
    assert {owner for name, owner in tables.items() if name.startswith("events_p")} == {"lockledger_migrator"}
    # Sequences (the identity columns') follow their tables.
    assert {owner for name, owner in tables.items() if name.endswith("_seq")} == {"lockledger_migrator"}
    assert set(functions.values()) == {"lockledger_migrator"}
    assert memberships == []


async def test_a_service_login_cannot_become_the_migrator(
    admin_pool: asyncpg.Pool, settings: Settings
) -> None:
    """In production the service logs in as its own user, a member of lockledger_service (SECURITY.md).
    Such a login can take the service role but never the owner's, so it can never disable the triggers."""
    login = f"lockledger_test_login_{uuid.uuid4().hex[:8]}"
    async with admin_pool.acquire() as admin:
        await admin.execute(f"CREATE ROLE {login} LOGIN IN ROLE lockledger_service")
    try:
        assert settings.database_url
        conn = await asyncpg.connect(asyncpg_dsn(settings.database_url), user=login)
        try:
            await conn.execute("SET ROLE lockledger_service")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("SET ROLE lockledger_migrator")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
            await conn.execute("RESET ROLE")  # back to the login itself: still not the owner
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("UPDATE events SET data = data")
        finally:
            await conn.close()
    finally:
        async with admin_pool.acquire() as admin:
            await admin.execute(f"DROP ROLE {login}")


async def test_a_revoked_token_stays_revoked(service_pool: asyncpg.Pool) -> None:
    """Even the service, which revokes tokens for admins, cannot take a revocation back."""
    name = f"revoked-{uuid.uuid4().hex[:8]}"
    async with service_pool.acquire() as conn:
        await tokens.create(conn, name, Role.ADMIN)
        assert await tokens.revoke(conn, name) == 1
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="revoked for good"):
            await conn.execute("UPDATE api_tokens SET revoked_at = NULL WHERE name = $1", name)
        assert name not in {t.name for t in await tokens.list_all(conn)}
