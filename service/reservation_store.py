"""Where a reservation's plans are committed in PostgreSQL (the ``AtomicLockStore`` port), and the
database guard and outage rule around it.

The plans go through the lock store's own command statement (``service/lock_store.py``: heads locked
in resource order and at their expected versions, the clock read once every head is locked, a renewed
or released lease re-checked live at that instant, the events appended, ``lock_state`` projected), but
inside one explicit transaction: that statement lets each plan stand or fall alone, and a reservation
stands or falls as a whole, so a plan without a row rolls every plan back. The events of one reservation
are therefore one transaction in the log (one ``tx_id``), or none.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from service import lock_store
from service.database import connection
from service.database_guard import DatabaseGuard
from service.outage import OutageWatch
from service.ports import AppendPlan, AtomicLockStore, CommitConflict, Committed


class _Refused(Exception):
    """A plan of the set did not stand: roll the whole set back."""


class PostgresReservationStore:
    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float) -> None:
        self._pool = pool
        self._acquire_timeout_s = acquire_timeout_s

    async def commit_all(self, plans: Sequence[AppendPlan]) -> list[Committed] | None:
        try:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                try:
                    async with conn.transaction():
                        results = await lock_store.commit_many(conn, list(plans))
                        committed = [result for result in results if result is not None]
                        if len(committed) != len(plans):
                            raise _Refused
                except _Refused:
                    return None
                return committed
        except (asyncpg.UniqueViolationError, asyncpg.DeadlockDetectedError) as error:
            # A key or a new stream taken concurrently; a deadlock with a writer that locks in another
            # order (none of lockledger's): nothing was written, the caller loads and decides again.
            raise CommitConflict(str(error)) from error


class GuardedReservations:
    """Every commit through the database guard, and after an outage only once the live leases were
    extended, as the lock store's adapters do for single commands (``service/store_adapters.py``)."""

    def __init__(
        self, inner: AtomicLockStore, guard: DatabaseGuard, outage_watch: OutageWatch | None = None
    ) -> None:
        self._inner = inner
        self._guard = guard
        self._watch = outage_watch

    async def commit_all(self, plans: Sequence[AppendPlan]) -> list[Committed] | None:
        if self._watch is None:
            return await self._guard.run(lambda: self._inner.commit_all(plans))
        await self._watch.resume_if_needed()
        try:
            return await self._guard.run(lambda: self._inner.commit_all(plans))
        except Exception as error:
            self._watch.saw_failure(error)
            raise
