"""The change feed's fan-out: one tailing reader per server process, bounded queues for subscribers.

The reader (``eventstore/tail.py``) polls the read pool every ``poll_s`` for the next window of committed
transactions and hands each matching event to every subscriber's queue. A queue never holds more than
``queue_size`` events: a subscriber that falls that far behind is marked overflowed, gets one final
``OVERFLOW`` item and receives nothing more (the HTTP layer tells the client where to resume and ends the
stream), so a slow client costs a bounded amount of memory. No ``NOTIFY`` is involved (docs/design.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final, TypeAlias

import asyncpg
import structlog
from prometheus_client import Gauge

from eventstore.tail import Cursor, Filter, Tail, TailEvent, Window, read_page

log = structlog.get_logger("lockledger.feed")

OVERFLOW: Final = "overflow"

OPEN = Gauge(
    "lockledger_feed_subscriptions",
    "Change-feed subscriptions of this process whose stream has not ended (each holds its queue)",
)
_PAGE = 500  # events per catch-up query


@dataclass(frozen=True, slots=True)
class Delivery:
    event: TailEvent
    cursor: Cursor  # the subscriber's place once it has this event: its SSE id


Batch: TypeAlias = list[Delivery | str]  # deliveries in order; an overflowed subscriber's last is OVERFLOW


@dataclass(eq=False)
class Subscription:
    flt: Filter
    start: Cursor  # where it stands before its first event
    queue_size: int
    live_from: int  # the reader's boundary when it subscribed: earlier windows come from its catch-up
    queue: asyncio.Queue[Delivery | str] = field(default_factory=asyncio.Queue)
    overflowed: bool = False
    ended: bool = False

    def offer(self, delivery: Delivery) -> None:
        if self.overflowed or delivery.cursor.lo < self.live_from:
            return
        if self.queue.qsize() >= self.queue_size:
            self.overflowed = True
            self.queue.put_nowait(OVERFLOW)  # the one item past the bound
            return
        self.queue.put_nowait(delivery)


class FutureCursor(ValueError):
    """A Last-Event-ID whose boundary this server's reader has not reached (and does not reach soon)."""


class Feed:
    def __init__(self, pool: asyncpg.Pool, *, poll_s: float = 0.1, queue_size: int = 1_000) -> None:
        self._pool = pool
        self._poll_s = poll_s
        self.queue_size = queue_size
        self._tail = Tail()
        self._subscribers: set[Subscription] = set()
        self._advanced = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._notifiers: set[asyncio.Task[None]] = set()

    @property
    def boundary(self) -> int | None:
        return self._tail.boundary

    async def start(self) -> None:
        async with self._pool.acquire() as conn:
            await self._tail.start(conn)
        self._task = asyncio.create_task(self._run(), name="change-feed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                async with self._pool.acquire() as conn:
                    window = await self._tail.poll(conn, wanted=lambda: bool(self._subscribers))
                    if window is not None:
                        self._hand_on(window)
                failures = 0
            except Exception as exc:  # the database down, a pool timeout: the reader must outlive them
                failures += 1
                log.warning("change feed read failed; retrying", error=repr(exc), failures=failures)
                await asyncio.sleep(min(5.0, self._poll_s * 2**failures))
                continue
            await asyncio.sleep(self._poll_s)

    def _hand_on(self, window: Window) -> None:
        """Called with no await since ``poll`` returned: a subscriber registers either before the boundary
        moves (and gets this window live) or after (and reads it from the database)."""
        self._tail.advance(window)
        for subscriber in list(self._subscribers):
            for event in window.events:
                if subscriber.flt.matches(event):
                    subscriber.offer(Delivery(event, Cursor(event.position, window.lo, window.hi)))
            if subscriber.overflowed:
                self._subscribers.discard(subscriber)
        self._advanced_now()

    def _advanced_now(self) -> None:
        waiter = asyncio.get_running_loop().create_task(self._notify())
        self._notifiers.add(waiter)
        waiter.add_done_callback(self._notifiers.discard)

    async def _notify(self) -> None:
        async with self._advanced:
            self._advanced.notify_all()

    async def _reached(self, hi: int, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s), self._advanced:
            await self._advanced.wait_for(lambda: self.boundary is not None and self.boundary >= hi)

    async def subscribe(
        self, flt: Filter, *, after: int | None, cursor: Cursor | None, wait_s: float = 5.0
    ) -> tuple[Subscription, AsyncIterator[Batch]]:
        """A subscription and its deliveries: the catch-up from the database (when resuming), then the
        live windows. ``after`` is a plain position (no boundary); ``cursor`` a full SSE id; neither: now.
        """
        if cursor is not None and (self.boundary is None or self.boundary < cursor.hi):
            try:
                await self._reached(cursor.hi, wait_s)
            except TimeoutError as exc:
                raise FutureCursor(f"the feed has not reached {cursor}") from exc
        now = self.boundary
        assert now is not None, "the feed is not started"
        if cursor is None:
            # A plain position: every event after it among all transactions below now (it carries no
            # boundary, so a late commit below it that it had not seen cannot be told apart).
            start = Cursor(after or 0, 0, now) if after is not None else Cursor(0, now, now)
        else:
            start = cursor
        subscription = Subscription(flt, start, self.queue_size, now)
        self._subscribers.add(subscription)  # no await since reading ``now``: the live windows start there
        OPEN.inc()
        return subscription, self._deliveries(subscription, now)

    def unsubscribe(self, subscription: Subscription) -> None:
        """The subscription's stream has ended: nothing more is queued for it."""
        self._subscribers.discard(subscription)
        if not subscription.ended:
            subscription.ended = True
            OPEN.dec()

    async def _catch_up(self, lo: int, hi: int, after: int, flt: Filter) -> AsyncIterator[Batch]:
        """The events of ``[lo, hi)`` after ``after`` from the database, a batch per page (no connection
        is held while the client reads)."""
        while True:
            async with self._pool.acquire() as conn:
                events = await read_page(conn, lo, hi, after=after, flt=flt, page=_PAGE)
            if events:
                yield [Delivery(event, Cursor(event.position, lo, hi)) for event in events]
            if len(events) < _PAGE:
                return
            after = events[-1].position

    async def _deliveries(self, subscription: Subscription, now: int) -> AsyncIterator[Batch]:
        """Batches of what is ready at once: a catch-up page, or everything queued when the subscriber
        takes from its queue (so a window reaches a client in one write, not one per event); the last
        batch of an overflowed subscriber ends with ``OVERFLOW``."""
        start, flt = subscription.start, subscription.flt
        # Phase A: the rest of the window the client was in; phase B: every window since, up to ``now``.
        async for batch in self._catch_up(start.lo, min(start.hi, now), start.position, flt):
            yield batch
        if start.hi < now:
            async for batch in self._catch_up(start.hi, now, self._tail.floor(start.hi), flt):
                yield batch
        queue = subscription.queue
        while True:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            yield ready
            if ready[-1] == OVERFLOW:
                return
