"""Saga heartbeats: keep a saga's own lease alive while its orchestrator runs it.

The server lapses the lease of a saga whose heartbeats stop (the orchestrator crashed or lost its
network): it then compensates the saga, or marks it ``stuck`` if nobody finishes it within a second
lease. While this process runs the saga, a background task sends ``POST /v1/sagas/{id}/heartbeat``
every third of the lease, so two heartbeats may be lost before the lease lapses. A heartbeat the server
cannot take is logged and tried again at the next beat; one refused because the saga has ended, is
another's, or is gone ends the task (nothing is left to keep alive), as does a client closed under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from lockledger.errors import LockLedgerError
from lockledger_breaker import CircuitOpen

__all__ = ["SagaHeartbeat"]

log = logging.getLogger("lockledger.saga")

_FINAL_STATUSES = (403, 404, 409)  # another's saga, no saga, an ended saga: stop beating


class SagaHeartbeat:
    """``beat()`` every ``lease / 3`` seconds from ``start()`` until ``stop()``."""

    def __init__(self, saga_id: str, lease: float, beat: Callable[[], Awaitable[object]]) -> None:
        self.saga_id = saga_id
        self.interval = lease / 3
        self._beat = beat
        self._task: asyncio.Task[None] | None = None
        self.beats = 0  # heartbeats the server took

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"saga-heartbeat:{self.saga_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._beat()
            except LockLedgerError as error:
                if error.status in _FINAL_STATUSES:
                    log.info("saga heartbeats end", extra={"saga_id": self.saga_id, "error": str(error)})
                    return
                log.warning("saga heartbeat failed", extra={"saga_id": self.saga_id, "error": str(error)})
            except CircuitOpen as error:
                log.warning("saga heartbeat failed", extra={"saga_id": self.saga_id, "error": str(error)})
            except RuntimeError as error:  # httpx: the client was closed while the saga was left open
                log.info("saga heartbeats end", extra={"saga_id": self.saga_id, "error": str(error)})
                return
            else:
                self.beats += 1
