"""The asyncpg pool: UTC session clock, the least-privileged role, bounded waits everywhere."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from eventstore.connection import Connection
from eventstore.dburl import asyncpg_dsn, multi_host, single_host_urls
from service.config import Settings
from service.database_guard import NOT_PRIMARY

log = structlog.get_logger("lockledger.database")


async def _reset(conn: Connection) -> None:
    """Return a connection to the pool without asyncpg's default reset round trip.

    The default (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``) costs one extra round
    trip per command. lockledger takes only transaction-scoped advisory locks, LISTENs only on dedicated
    connections, sets no session state after connect, and runs each command as single statements; only
    an interrupted explicit transaction needs undoing.
    """
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


# The command path's sessions never plan a sequential scan where an index can serve. Every statement it
# runs is keyed (by resource, Idempotency-Key, token hash, deadline), and asyncpg caches each one's plan
# per connection. A plan made while a table held a page or two (just created, or analyzed when nearly
# empty) chose a sequential scan, which was cheapest then, and kept it while the table grew: every
# commit batch then read the whole of lock_state (docs/decisions/0008-per-key-statements.md). A scan is
# still used where no index applies; it is only never preferred to one.
COMMAND_PATH_SETTINGS = {
    "enable_seqscan": "off",
    # A session left idle inside a transaction (its process frozen, or stuck between two statements)
    # would hold its row locks, the outage beacon's among them, for every other instance to wait on.
    # Every transaction of the command path is a few statements sent back to back.
    "idle_in_transaction_session_timeout": "10000",  # ms
}


async def create_pool(
    settings: Settings, *, role: str | None = None, url: str | None = None, max_size: int | None = None
) -> asyncpg.Pool:
    """A pool whose sessions run as the service role (or ``role``) with UTC timestamps in JSON, on the
    main database (or ``url``, e.g. a replica for the read-only role). The service role's pool, the
    command path's, also takes ``COMMAND_PATH_SETTINGS``; the query side plans as PostgreSQL likes.

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
    if role is None:
        server_settings.update(COMMAND_PATH_SETTINGS)
    dsn = asyncpg_dsn(url)
    connect: Any = _connect_host_by_host if multi_host(dsn) else None  # asyncpg's protocol type is private
    pool = await asyncpg.create_pool(
        dsn,
        connect=connect,
        min_size=min(settings.pool_min_size, max_size or settings.pool_max_size),
        max_size=max_size or settings.pool_max_size,
        command_timeout=settings.command_timeout_s,
        server_settings=server_settings,
        reset=_reset,
    )
    assert pool is not None
    return pool


# How long one server of a multi-host URL may take to accept a session before the next is tried.
HOST_CONNECT_TIMEOUT_S = 3.0


async def _connect_host_by_host(dsn: str, **options: Any) -> asyncpg.Connection:
    """A multi-host URL's servers tried in order, each within ``HOST_CONNECT_TIMEOUT_S``.

    asyncpg tries them under one timeout for the whole attempt (60 s), and moves on only when a server
    refuses: a host that accepts connections but never answers (frozen, or hung) takes all of it, and the
    primary listed after it is never reached. Each server alone is asked with the URL's own
    ``target_session_attrs``, so a standby is passed over as asyncpg would."""
    errors: list[BaseException] = []
    for single in single_host_urls(dsn):
        try:
            async with asyncio.timeout(HOST_CONNECT_TIMEOUT_S):
                return await asyncpg.connect(single, **options)
        except (
            OSError,
            TimeoutError,
            asyncpg.PostgresError,
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,  # TargetServerAttributeNotMatched: a standby, for read-write
        ) as error:
            errors.append(error)
    raise errors[-1]


@contextlib.asynccontextmanager
async def connection(
    pool: asyncpg.Pool, timeout_s: float
) -> AsyncIterator[PoolConnectionProxy[asyncpg.Record]]:
    """A pooled connection (waiting at most ``timeout_s`` for one) that is closed, never reused, when an
    operation on it was cut off mid-way: a timeout while the server restarted can leave its protocol in
    a state no later statement gets out of (asyncpg's ``InternalClientError``).

    Neither end of the loan makes the caller wait for the event loop. asyncpg bounds
    ``acquire(timeout=...)`` with ``asyncio.wait_for``, which on Python 3.11 runs the wait in a task of
    its own, and ``release`` runs in another (``asyncio.shield``). Each such task is a trip to the back
    of the loop's ready queue, and under load that queue holds a burst of other requests
    (docs/decisions/0015-fewer-event-loop-passes.md). So the wait is bounded by ``asyncio.timeout``
    instead, which needs no task, and the release goes on in the background: the caller already has its
    answer, and the connection is back in the pool one pass of the loop later. Only after a failure is
    the release waited for: a statement cut off by its timeout leaves the connection waiting for
    PostgreSQL to confirm the cancel, and while the server is frozen that wait is what tells the
    database guard (``service/database_guard.py``) that round trips have stalled.
    """
    async with asyncio.timeout(timeout_s):
        conn = await pool.acquire()
    try:
        yield conn
    except BaseException as error:
        if isinstance(error, asyncpg.InternalClientError):
            conn.terminate()
        if isinstance(error, NOT_PRIMARY):
            await pool.expire_connections()
        await pool.release(conn)
        raise
    _release_later(pool, conn)


_releasing: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones


def _release_later(pool: asyncpg.Pool, conn: PoolConnectionProxy[asyncpg.Record]) -> None:
    task = asyncio.get_running_loop().create_task(pool.release(conn))
    _releasing.add(task)
    task.add_done_callback(_released)


def _released(task: asyncio.Task[None]) -> None:
    _releasing.discard(task)
    if not task.cancelled() and (error := task.exception()) is not None:
        # asyncpg has already closed a connection it could not reset; nothing is lost but the connection.
        log.warning("pool release failed", error=repr(error))
