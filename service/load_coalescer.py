"""Coalescing concurrent loads into one database round trip.

Every command starts by reading its stream head (``lock_store.load``). Under load many commands wait to
do that at the same moment, and on a small machine each round trip costs more in system calls than the
query itself. The coalescer sends whatever loads are waiting as one ``load_many`` query, with at most
``max_in_flight`` such queries outstanding. It never delays a load when the database is idle (the first
load goes out at once), so a lone command pays nothing.

Reads are snapshots and decisions are re-validated by the commit (expected version, liveness at the
append), so reading several heads in one statement changes no outcome.
"""

from __future__ import annotations

import asyncio

import asyncpg

from service import lock_store
from service.lock_store import Snapshot

_Request = tuple[str, str, str | None]


class LoadCoalescer:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        max_in_flight: int = 4,
        max_batch: int = 256,
        acquire_timeout_s: float = 5.0,
    ) -> None:
        self._pool = pool
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._acquire_timeout_s = acquire_timeout_s
        self._pending: list[tuple[_Request, asyncio.Future[Snapshot]]] = []
        self._in_flight = 0

    async def load(self, resource: str, principal: str, key: str | None) -> Snapshot:
        future: asyncio.Future[Snapshot] = asyncio.get_running_loop().create_future()
        self._pending.append(((resource, principal, key), future))
        if self._in_flight < self._max_in_flight:
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        """Send batches until nothing waits; the task that finds the queue empty retires."""
        try:
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                await self._send(batch)
        finally:
            self._in_flight -= 1

    async def _send(self, batch: list[tuple[_Request, asyncio.Future[Snapshot]]]) -> None:
        try:
            async with self._pool.acquire(timeout=self._acquire_timeout_s) as conn:
                if len(batch) == 1:
                    snapshots = [await lock_store.load(conn, *batch[0][0])]
                else:
                    snapshots = await lock_store.load_many(conn, [request for request, _ in batch])
        except BaseException as error:  # every waiter must hear about the failure, whatever it is
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for (_, future), snapshot in zip(batch, snapshots, strict=True):
            if not future.done():
                future.set_result(snapshot)
