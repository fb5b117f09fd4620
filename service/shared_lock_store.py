"""The shared locks' store in PostgreSQL (the ``SharedLockStore`` port, ``service/ports.py``): one
statement to load a shared lock, one to commit a decision (``projections/shared_locks.py``)."""

from __future__ import annotations

import asyncpg

from projections.shared_locks import (
    SharedCommitted,
    SharedPlan,
    SharedSnapshot,
    commit_shared,
    due_shared,
    load_shared,
)
from service.database import connection
from service.ports import CommitConflict


class PostgresSharedLockStore:
    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float) -> None:
        self._pool = pool
        self._timeout_s = acquire_timeout_s

    async def load(self, resource: str, principal: str, key: str | None) -> SharedSnapshot:
        async with connection(self._pool, self._timeout_s) as conn:
            return await load_shared(conn, resource, principal, key)

    async def commit(self, plan: SharedPlan) -> SharedCommitted | None:
        try:
            async with connection(self._pool, self._timeout_s) as conn:
                return await commit_shared(conn, plan)
        except asyncpg.UniqueViolationError as error:  # a key, or the stream, taken concurrently
            raise CommitConflict(str(error)) from error

    async def due(self, limit: int) -> list[str]:
        async with connection(self._pool, self._timeout_s) as conn:
            return await due_shared(conn, limit)
