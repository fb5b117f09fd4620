"""Coalescing concurrent database work into one round trip.

Under load many commands want the database at the same moment, and on a small machine each round trip
costs more in system calls (client and server) than the statement itself. A coalescer sends whatever
requests are waiting as one batch. It never delays a request when the database is idle: the first one
goes out at once, alone, through the single-request path, so a lone command pays nothing.

One batch is out at a time while batches come back on time; what arrives meanwhile waits for it and
leaves together as the next. A second batch (up to ``max_in_flight``) goes out only once every batch
out is *late*: out longer than ``late_factor`` times the usual round trip (a moving average, never less
than ``min_late_s``; ``late_factor=None`` lets every batch go out at once, up to the cap). So a batch
stuck behind a row lock or a slow statement does not hold up everything behind it, and at moderate load
commands are not sent one per round trip into spare lanes, each round trip costing the server and
PostgreSQL a wake-up (docs/decisions/0011-one-commit-batch-at-a-time.md).
Until a round trip has been timed, any batch out 1 ms is late.

Requests that must not share a batch (two commits on one resource, or under one Idempotency-Key) say
so through ``keys``; the later one waits for the next batch. If a batch fails as a whole, each of its
requests is retried alone, so every caller gets exactly the outcome (or the error) of its own request,
except when the error says the database itself is unreachable (``retry_alone`` is false for it).

``on_batch`` hears of every batch once it is answered: how many requests it held and how many seconds
it took, retries included. That is what an operator needs to see whether coalescing pays (commands per
batch) and where a command's time goes (the round trip against the whole request).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Generic, TypeVar

# A batch out longer than this many usual round trips is late, and what waits behind it gets a lane.
LATE_FACTOR = 2.0

Request = TypeVar("Request")
Result = TypeVar("Result")


class Coalescer(Generic[Request, Result]):
    def __init__(
        self,
        run_one: Callable[[Request], Awaitable[Result]],
        run_many: Callable[[list[Request]], Awaitable[list[Result]]],
        *,
        max_in_flight: int = 4,
        max_batch: int = 256,
        late_factor: float | None = LATE_FACTOR,
        min_late_s: float = 0.001,
        keys: Callable[[Request], Iterable[Hashable]] | None = None,
        retry_alone: Callable[[Exception], bool] = lambda error: True,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        self._run_one = run_one
        self._run_many = run_many
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._late_factor = late_factor
        self._min_late_s = min_late_s
        self._keys = keys
        self._retry_alone = retry_alone
        self._on_batch = on_batch
        self._pending: list[tuple[Request, asyncio.Future[Result]]] = []
        self._in_flight = 0  # batching tasks running (each sends one batch after another)
        self._on_time = 0  # of the batches out, those not yet late: while any is, no new task starts
        self._usual_s: float | None = None  # moving average of a batch's round trip
        self._tasks: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones
        self.batches = 0
        self.requests = 0

    async def submit(self, request: Request) -> Result:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self._pending.append((request, future))
        self._open_lane(loop)
        return await future

    def _open_lane(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start a batching task if none is sending or every batch out is late (and the cap allows)."""
        free = self._on_time == 0 or self._late_factor is None
        if free and self._in_flight < self._max_in_flight and self._pending:
            self._in_flight += 1
            task = loop.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _late_after_s(self) -> float:
        usual, factor = self._usual_s, self._late_factor
        return self._min_late_s if usual is None or factor is None else max(self._min_late_s, factor * usual)

    async def _drain(self) -> None:
        """Send batches until nothing waits; the task that finds the queue empty retires."""
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch = self._take_batch()
                started = time.perf_counter()
                self._on_time += 1
                late = False

                def mark_late() -> None:
                    nonlocal late
                    late = True
                    self._on_time -= 1
                    self._open_lane(loop)  # what waits behind a late batch gets a lane of its own

                timer = loop.call_later(self._late_after_s(), mark_late)
                try:
                    await self._send(batch)
                finally:
                    timer.cancel()
                    if not late:
                        self._on_time -= 1
                elapsed = time.perf_counter() - started
                self._usual_s = elapsed if self._usual_s is None else 0.9 * self._usual_s + 0.1 * elapsed
                if self._on_batch is not None:
                    self._on_batch(len(batch), elapsed)
        finally:
            self._in_flight -= 1

    def _take_batch(self) -> list[tuple[Request, asyncio.Future[Result]]]:
        if self._keys is None:
            head = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            return head
        batch: list[tuple[Request, asyncio.Future[Result]]] = []
        rest: list[tuple[Request, asyncio.Future[Result]]] = []
        taken: set[Hashable] = set()
        for item in self._pending:
            keys = set(self._keys(item[0]))
            if len(batch) < self._max_batch and not keys & taken:
                batch.append(item)
                taken |= keys
            else:
                rest.append(item)
        self._pending = rest
        return batch

    async def _send(self, batch: list[tuple[Request, asyncio.Future[Result]]]) -> None:
        self.batches += 1
        self.requests += len(batch)
        if len(batch) == 1:
            # A lone request runs in this task: gather would wrap it in a task of its own, one more pass
            # through the event loop before it even leaves.
            await self._send_one(*batch[0])
            return
        try:
            results = await self._run_many([request for request, _ in batch])
        except Exception as error:
            # Retried one by one below, so each caller sees its own outcome; unless the failure is not
            # about the batch (the database is unreachable): then retrying alone would only multiply
            # the wait, and everyone gets the error now.
            if not self._retry_alone(error):
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                return
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
            return
        await asyncio.gather(*(self._send_one(request, future) for request, future in batch))

    async def _send_one(self, request: Request, future: asyncio.Future[Result]) -> None:
        try:
            result = await self._run_one(request)
        except Exception as error:
            if not future.done():
                future.set_exception(error)
        else:
            if not future.done():
                future.set_result(result)
