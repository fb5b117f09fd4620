"""The lock store in PostgreSQL (the ``LockStore`` port, ``service/ports.py``).

``PostgresStore`` sends one statement per call (``service/lock_store.py``) on a pooled connection: the
load and the commit, each for many commands at once (a batch of one is a batch). The commit keeps the
port's rules in SQL: a plan stands only if its stream is still at the expected version and, for a renew
or release, its lease is still live by ``clock_timestamp()`` at that instant; it stamps a grant's
deadline from that clock and keeps the response under the Idempotency-Key. ``MemoryLockStore``
(``service/fakes/lock_store.py``) keeps the same contract in a process; the performance machinery wraps
either as adapters with the same interface (``service/store_adapters.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from service import lock_store
from service.database import connection
from service.ports import AppendPlan, CommitConflict, Committed, LoadRequest, Snapshot


class PostgresStore:
    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float) -> None:
        self._pool = pool
        self._acquire_timeout_s = acquire_timeout_s

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        async with connection(self._pool, self._acquire_timeout_s) as conn:
            return await lock_store.load_many(conn, [(r.resource, r.principal, r.key) for r in requests])

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        try:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                return await lock_store.commit_many(conn, list(plans))
        except asyncpg.UniqueViolationError as error:
            raise CommitConflict(str(error)) from error
