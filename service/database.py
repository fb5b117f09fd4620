"""The asyncpg pool: UTC session clock, the least-privileged role, bounded waits everywhere."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from eventstore.connection import Connection
from lockledger.dburl import asyncpg_dsn
from service.config import Settings


async def _reset(conn: Connection) -> None:
    """Return a connection to the pool without asyncpg's default reset round trip.

    The default (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``) costs one extra round
    trip per command. lockledger takes only transaction-scoped advisory locks, LISTENs only on dedicated
    connections, sets no session state after connect, and runs each command as single statements; only
    an interrupted explicit transaction needs undoing.
    """
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


async def create_pool(
    settings: Settings, *, role: str | None = None, url: str | None = None, max_size: int | None = None
) -> asyncpg.Pool:
    """A pool whose sessions run as the service role (or ``role``) with UTC timestamps in JSON, on the
    main database (or ``url``, e.g. a replica for the read-only role).

    The role and time zone are startup parameters, so they hold for the connection's whole life whatever
    a session does; a connection returns to the pool through ``_reset``, not asyncpg's ``RESET ALL``.
    """
    url = url or settings.database_url
    if not url:
        raise ValueError("settings.database_url is not set")
    server_settings = {
        "timezone": "UTC",
        "statement_timeout": str(settings.statement_timeout_ms),
        "application_name": "lockledger",
    }
    chosen_role = settings.database_role if role is None else role
    if chosen_role:
        server_settings["role"] = chosen_role
    pool = await asyncpg.create_pool(
        asyncpg_dsn(url),
        min_size=min(settings.pool_min_size, max_size or settings.pool_max_size),
        max_size=max_size or settings.pool_max_size,
        command_timeout=settings.command_timeout_s,
        server_settings=server_settings,
        reset=_reset,
    )
    assert pool is not None
    return pool


@contextlib.asynccontextmanager
async def connection(
    pool: asyncpg.Pool, timeout_s: float
) -> AsyncIterator[PoolConnectionProxy[asyncpg.Record]]:
    """A pooled connection (waiting at most ``timeout_s`` for one) that is closed, never reused, when an
    operation on it was cut off mid-way: a timeout while the server restarted can leave its protocol in
    a state no later statement gets out of (asyncpg's ``InternalClientError``)."""
    async with pool.acquire(timeout=timeout_s) as conn:
        try:
            yield conn
        except asyncpg.InternalClientError:
            conn.terminate()
            raise
