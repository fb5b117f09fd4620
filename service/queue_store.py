"""The fair queue of waiting acquires in PostgreSQL (the ``Queue`` port, ``service/ports.py``), and what
wakes its waiters on every server: ``LISTEN``/``NOTIFY`` on one channel, the payload a resource.

- ``enter``: a ticket for a refused acquire, numbered by the table's identity in arrival order. The
  statement first locks the lock's head row (``lock_state``, ``FOR UPDATE``), so tickets of one lock are
  numbered and committed in the order their statements took that lock, and a commit serialized after
  one sees it (``lock_queue_ahead``, migrations/versions/0015_lock_queue.py). Its deadline is the wait's
  end by the database clock: a waiter whose server died stops counting then.
- ``leave``: a waiter gives up; if others still wait, ``NOTIFY`` them (the lock may be theirs now).
- ``announce``: a commit freed a lock while acquires queue for it; ``NOTIFY``, in its own statement after
  that commit, never inside the append (DESIGN: a pending NOTIFY serializes every commit).
- ``QueueListener``: one connection per server that ``LISTEN``s, opened when the first acquire waits.
- ``queue_of``: the live tickets of a lock, for ``GET /v1/locks/{r}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime

import asyncpg
import structlog

from domain.shared_lock import STREAM_PREFIX as SHARED_PREFIX
from domain.value import value
from eventstore.connection import Connection
from service.database import connection
from service.ports import NotifierUnavailable

log = structlog.get_logger("lockledger.queue")

CHANNEL = "lockledger_queue"

ENTER_SQL = """
WITH head AS (SELECT resource FROM lock_state WHERE resource = $1 FOR UPDATE)
INSERT INTO lock_queue (resource, owner, server, since, deadline)
SELECT resource, $2, $3, clock_timestamp(), clock_timestamp() + $4::integer * interval '1 millisecond'
  FROM head
RETURNING ticket
"""

# A shared lock's queue is keyed by its stream id (``shared/<resource>``) and ordered by its own head row
# (``shared_locks``, projections/shared_locks.py), which its commit locks as a mutex's locks lock_state.
ENTER_SHARED_SQL = """
WITH head AS (SELECT resource FROM shared_locks WHERE resource = $5 FOR UPDATE)
INSERT INTO lock_queue (resource, owner, server, since, deadline, exclusive)
SELECT $1, $2, $3, clock_timestamp(), clock_timestamp() + $4::integer * interval '1 millisecond', $6
  FROM head
RETURNING ticket
"""

LEAVE_SQL = f"""
WITH gone AS (DELETE FROM lock_queue WHERE ticket = $1 RETURNING resource)
SELECT pg_notify('{CHANNEL}', gone.resource) FROM gone
 WHERE EXISTS (SELECT 1 FROM lock_queue q
                WHERE q.resource = gone.resource AND q.ticket <> $1 AND q.deadline > clock_timestamp())
"""

ANNOUNCE_SQL = f"SELECT pg_notify('{CHANNEL}', $1)"

QUEUE_SQL = """
SELECT owner, since, deadline, exclusive FROM lock_queue
 WHERE resource = $1 AND deadline > clock_timestamp()
 ORDER BY ticket
"""

_FAILURES = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


@value
class Waiting:
    """One live ticket of a lock's queue, as the query side shows it."""

    owner: str
    since: datetime
    deadline: datetime
    exclusive: bool = True  # waits for an exclusive grant (a shared lock's reader does not)


async def queue_of(conn: Connection, resource: str) -> list[Waiting]:
    """The acquires waiting for ``resource`` (a shared lock's stream id for its queue), first in line first
    (expired tickets left out)."""
    rows = await conn.fetch(QUEUE_SQL, resource)
    return [Waiting(row["owner"], row["since"], row["deadline"], row["exclusive"]) for row in rows]


class PostgresQueue:
    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float, server: str) -> None:
        self._pool = pool
        self._acquire_timeout_s = acquire_timeout_s
        self._server = server

    async def enter(self, resource: str, owner: str, wait_ms: int, exclusive: bool = True) -> int | None:
        """A ticket for ``owner`` at the end of ``resource``'s queue, live for ``wait_ms``; None when the
        lock has no head row (never taken: nothing to wait for). ``resource`` is a mutex's resource or a
        shared lock's stream id; ``exclusive`` marks a ticket waiting for an exclusive grant (a reader's
        is not). Raises ``NotifierUnavailable``."""
        try:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                if resource.startswith(SHARED_PREFIX):
                    ticket = await conn.fetchval(
                        ENTER_SHARED_SQL, resource, owner, self._server, wait_ms,
                        resource.removeprefix(SHARED_PREFIX), exclusive,
                    )  # fmt: skip
                else:
                    ticket = await conn.fetchval(ENTER_SQL, resource, owner, self._server, wait_ms)
        except _FAILURES as error:
            raise NotifierUnavailable(str(error)) from error
        return None if ticket is None else int(ticket)

    async def leave(self, ticket: int) -> None:
        """Remove ``ticket`` (gone already when it was granted) and wake those behind it. A failure is
        logged, not raised: the ticket's deadline ends it anyway."""
        try:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                await conn.execute(LEAVE_SQL, ticket)
        except _FAILURES as error:
            log.warning("cannot leave the queue; the ticket lapses at its deadline", error=str(error))

    async def announce(self, resource: str) -> None:
        """Wake the acquires queued for ``resource`` on every server (it came free)."""
        try:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                await conn.execute(ANNOUNCE_SQL, resource)
        except _FAILURES as error:
            # The first waiter still tries at its holder's deadline, or when its wait runs out.
            log.warning("cannot wake the queue", resource=resource, error=str(error))


class QueueListener:
    """One pooled connection that ``LISTEN``s on ``CHANNEL`` for this server's waiters: ``on_wake`` gets
    each notified resource, ``on_lost`` is called when the connection dies (every waiter should look
    again: a notification may have been missed). Held from the first wait until ``close``."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        acquire_timeout_s: float,
        on_wake: Callable[[str], None],
        on_lost: Callable[[], None],
    ) -> None:
        self._pool = pool
        self._acquire_timeout_s = acquire_timeout_s
        self._on_wake = on_wake
        self._on_lost = on_lost
        self._conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record] | None = None
        self._opening = asyncio.Lock()

    async def listening(self) -> None:
        """Return once notifications reach ``on_wake``. Raises ``NotifierUnavailable``."""
        if self._conn is not None and not self._conn.is_closed():
            return
        async with self._opening:
            if self._conn is not None and not self._conn.is_closed():
                return
            try:
                async with asyncio.timeout(self._acquire_timeout_s):
                    conn = await self._pool.acquire()
                    try:
                        await conn.add_listener(CHANNEL, self._notified)
                    except BaseException:
                        await self._pool.release(conn)
                        raise
            except _FAILURES as error:
                raise NotifierUnavailable(str(error)) from error
            conn.add_termination_listener(self._terminated)
            self._conn = conn

    def _notified(self, _conn: object, _pid: int, _channel: str, resource: object) -> None:
        self._on_wake(str(resource))

    def _terminated(self, _conn: object) -> None:
        self._conn = None
        self._on_lost()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.remove_termination_listener(self._terminated)
            await conn.remove_listener(CHANNEL, self._notified)
        except _FAILURES as error:
            log.info("queue listener closed uncleanly", error=str(error))
        finally:
            await self._pool.release(conn)
