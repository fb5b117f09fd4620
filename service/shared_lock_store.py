"""The shared locks' store in PostgreSQL (the ``SharedLockStore`` port, ``service/ports.py``): one
statement to load a shared lock, one to commit a decision (``projections/shared_locks.py``); the outage
rule and the in-flight ordering around it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg

from projections.shared_locks import (
    SharedCommitted,
    SharedPlan,
    SharedSnapshot,
    commit_shared,
    due_shared,
    load_shared,
)
from service.appends_in_flight import AppendsInFlight
from service.database import connection
from service.outage import OutageWatch
from service.ports import CommitConflict, SharedLockStore

T = TypeVar("T")


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


class SharedAfterOutage:
    """A round trip after the database was unreachable first extends what the outage would have lapsed
    (``service/outage.py``), as the lock store's ``AfterOutage`` does for mutex leases."""

    def __init__(self, inner: SharedLockStore, watch: OutageWatch) -> None:
        self._inner = inner
        self._watch = watch

    async def load(self, resource: str, principal: str, key: str | None) -> SharedSnapshot:
        return await self._after_outage(lambda: self._inner.load(resource, principal, key))

    async def commit(self, plan: SharedPlan) -> SharedCommitted | None:
        return await self._after_outage(lambda: self._inner.commit(plan))

    async def due(self, limit: int) -> list[str]:
        return await self._after_outage(lambda: self._inner.due(limit))

    async def _after_outage(self, work: Callable[[], Awaitable[T]]) -> T:
        await self._watch.resume_if_needed()
        try:
            return await work()
        except Exception as error:
            self._watch.saw_failure(error)
            raise


class SharedInFlightOrdering:
    """A load waits until no commit of this process is in flight on its shared lock, as the lock store's
    ``InFlightOrdering`` (``service/store_adapters.py``): agents taking and releasing grants of one lock
    at once otherwise decide on a version that a commit on its way is about to move, and lose the
    commit's version check again and again."""

    def __init__(self, inner: SharedLockStore) -> None:
        self._inner = inner
        self._appending = AppendsInFlight()

    async def load(self, resource: str, principal: str, key: str | None) -> SharedSnapshot:
        if self._appending.busy(resource):
            await self._appending.settled(resource)
        return await self._inner.load(resource, principal, key)

    async def commit(self, plan: SharedPlan) -> SharedCommitted | None:
        self._appending.begin(plan.resource)
        try:
            return await self._inner.commit(plan)
        finally:
            self._appending.end(plan.resource)

    async def due(self, limit: int) -> list[str]:
        return await self._inner.due(limit)
