"""Acquires that wait for a held lock to come free (``wait_ms``), and what wakes them.

An agent that wants a zone another agent holds would otherwise poll: every poll is a request, a read
and a 409, and the first poll after the release wins by luck, not by order. A waiting acquire instead
stays with the server, which tries again only when the lock may have come free.

With a ``Queue`` (PostgreSQL, ``service/queue_store.py``; docs/decisions/0049-fair-queues.md) the order
spans every server on the database: a refused acquire takes a ticket in the lock's queue, and the store
grants a free lock only to the first live ticket, so acquires are served in arrival order wherever they
arrived. They are woken by the database: a commit that frees a lock while tickets wait sends a
``NOTIFY`` after it commits, which every server's ``Listener`` hands to the first of its own waiters on
that lock (the others cannot be first in line yet); a waiter that gives up leaves the queue and wakes
those behind it. Nothing is polled: besides a wake, a waiter tries again only when the refusal may be
overturned by the clock alone (the holder's deadline, or the deadline of a ticket ahead whose server may
have died), and once when its own wait runs out.

Without one (the in-memory fakes) waiters take turns in this process only (``asyncio.Lock`` is FIFO), and
releases through other processes are seen by asking the ``Notifier`` every ``poll_s`` while anyone
waits. Waiting reservations (``Waiters.watch``) take no place in any queue and are woken by both.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import structlog
from prometheus_client import Gauge, Histogram

from domain.errors import LockHeld
from domain.shared_lock import STREAM_PREFIX as SHARED_PREFIX
from service.errors import Unavailable
from service.ports import Listener, Notifier, NotifierUnavailable, Queue

log = structlog.get_logger("lockledger.waiters")

_WAITING = Gauge("lockledger_acquires_waiting", "Acquires waiting for a held lock to come free")
_WAITED = Histogram(
    "lockledger_acquire_wait_seconds",
    "How long acquires that were refused at first waited, by how the wait ended",
    ["outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
_GRANTED = _WAITED.labels("granted")
_TIMED_OUT = _WAITED.labels("timed_out")
_ABANDONED = _WAITED.labels("abandoned")
_SHUT_DOWN = _WAITED.labels("shutdown")

T = TypeVar("T")

# A lease is past its deadline only once the database clock reaches it: try a moment after.
_DUE_SLACK_S = 0.005
# A ticket outlives its waiter's wait by this much, so that the waiter's last attempt (at the end of its
# wait) is still decided with its place in the queue: a ticket that lapsed first would let a later one be
# granted before it. The waiter removes its ticket as it gives up; only a ticket whose server died (or
# could not remove it) counts this long after the wait.
TICKET_GRACE_MS = 1_000


class Line:
    """The waiters on one lock in this process. In-process turns: the one holding ``turn`` is the next to
    try. Queued waiters: ``tickets``, each with its own event, and a wake reaches only the first of them.
    Watchers (waiting reservations, ``Waiters.watch``) take no turn: each has its own event, set on every
    wake. On a shared lock's line (``together``) a wake reaches every ticket: waiting readers may be
    granted together, and the store's queue rule keeps each behind the writers that came first."""

    __slots__ = ("freed", "tickets", "together", "turn", "waiters", "watchers")

    def __init__(self, together: bool = False) -> None:
        self.together = together
        self.turn = asyncio.Lock()
        self.freed = asyncio.Event()
        self.waiters = 0
        self.tickets: dict[int, asyncio.Event] = {}
        self.watchers: set[asyncio.Event] = set()

    def wake(self) -> None:
        self.freed.set()
        if self.together:
            for event in self.tickets.values():
                event.set()
        elif self.tickets:
            self.tickets[min(self.tickets)].set()
        for watcher in self.watchers:
            watcher.set()

    def wake_all(self) -> None:
        self.wake()
        for event in self.tickets.values():
            event.set()

    async def wait_freed(self, timeout_s: float) -> bool:
        """Whether the lock may have come free within ``timeout_s``."""
        return await _wait_for(self.freed, timeout_s)


async def _wait_for(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s``."""
    if event.is_set():
        return True
    if timeout_s <= 0:
        return False
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


ListenerFactory = Callable[[Callable[[str], None], Callable[[], None]], Listener]


class Waiters:
    """``listen`` builds the listener from its two callbacks: a resource was freed, wakes were lost."""

    def __init__(
        self,
        notifier: Notifier,
        *,
        poll_s: float,
        queue: Queue | None = None,
        listen: ListenerFactory | None = None,
    ) -> None:
        self._notifier = notifier
        self._poll_s = poll_s
        self._queue = queue
        self._listener = None if listen is None else listen(self.freed, self._wake_all)
        self._lines: dict[str, Line] = {}
        self._follower: asyncio.Task[None] | None = None
        self._draining = False

    @property
    def waiting(self) -> int:
        return sum(line.waiters for line in self._lines.values())

    @property
    def draining(self) -> bool:
        """The server is shutting down: no wait may start or go on."""
        return self._draining

    async def acquire(
        self,
        resource: str,
        owner: str,
        attempt: Callable[[int | None], Awaitable[T]],
        wait_s: float,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
        exclusive: bool = True,
    ) -> T:
        """``attempt(ticket)``, and again each time ``resource`` may have come free, until it is not refused
        with ``LockHeld`` or ``wait_s`` has passed. The answer at the deadline is a last attempt, not the
        refusal remembered from the last wake: it may still be granted, and a database that went away
        meanwhile is reported as such (503), not as a holder it can no longer vouch for. ``abandoned``
        says whether the caller has gone (its connection closed): it is asked before each new attempt,
        so a lock is never taken for a client that stopped waiting. ``ticket`` is the caller's place in
        the lock's queue (None before it has one, and always without a ``Queue``). ``resource`` may be a
        shared lock's stream id; ``exclusive`` says whether its ticket waits for an exclusive grant."""
        if self._queue is None or self._listener is None:
            return await self._acquire_in_process(resource, lambda: attempt(None), wait_s, abandoned)
        try:
            return await attempt(None)
        except LockHeld as held:
            refusal = held
        started = time.monotonic()
        if self._draining:
            raise _shutting_down()
        async with self.line(resource, queued=True) as line:
            try:
                await self._listener.listening()  # before the ticket: no wake after it may be missed
                ticket = await self._queue.enter(
                    resource, owner, int(wait_s * 1000) + TICKET_GRACE_MS, exclusive
                )
            except NotifierUnavailable as error:
                raise Unavailable(f"cannot queue for {resource}: {error}", retry_after_s=1) from error
            if ticket is None:  # nothing to queue behind: decide again at once
                return await attempt(None)
            return await self._wait_in_queue(
                line, ticket, attempt, refusal, started, started + wait_s, abandoned
            )

    async def _wait_in_queue(
        self,
        line: Line,
        ticket: int,
        attempt: Callable[[int | None], Awaitable[T]],
        refusal: LockHeld,
        started: float,
        give_up_at: float,
        abandoned: Callable[[], Awaitable[bool]] | None,
    ) -> T:
        """Try with ``ticket`` now (a lock freed before the ticket was taken woke nobody), then on each
        wake, at the refusal's due time, and once more when the wait runs out. Leaves the queue unless
        granted (a grant removes the ticket in its own commit)."""
        assert self._queue is not None
        woken = line.tickets[ticket] = asyncio.Event()
        granted = False
        try:
            while True:
                if self._draining:
                    _SHUT_DOWN.observe(time.monotonic() - started)
                    raise _shutting_down()
                if abandoned is not None and await abandoned():
                    _ABANDONED.observe(time.monotonic() - started)
                    raise refusal
                woken.clear()  # a wake from now on is news to this attempt
                try:
                    result = await attempt(ticket)
                except LockHeld as held:
                    refusal = held
                else:
                    granted = True
                    _GRANTED.observe(time.monotonic() - started)
                    return result
                left = give_up_at - time.monotonic()
                if left <= 0:
                    _TIMED_OUT.observe(time.monotonic() - started)
                    raise refusal
                due = refusal.due_in_s
                await _wait_for(woken, left if due is None else min(left, max(due, 0.0) + _DUE_SLACK_S))
        finally:
            del line.tickets[ticket]
            if not granted:
                # Shielded: a waiter cancelled (its server stopping) still leaves, and wakes the next.
                await asyncio.shield(self._queue.leave(ticket))

    async def _acquire_in_process(
        self,
        resource: str,
        attempt: Callable[[], Awaitable[T]],
        wait_s: float,
        abandoned: Callable[[], Awaitable[bool]] | None,
    ) -> T:
        """``acquire`` without a queue: turns in this process, releases elsewhere seen by the follower."""
        try:
            return await attempt()
        except LockHeld as held:
            refusal = held
        # No other task ran between the refusal and joining the line. A release this process committed
        # after the refusal's read but before its answer came back woke nobody (there was no line yet);
        # the follower sees that one at its next look.
        started = time.monotonic()
        give_up_at = started + wait_s
        if self._draining:
            raise _shutting_down()
        async with self.line(resource) as line:
            # Behind others, the lock has changed hands since the refusal: try as soon as it is our turn.
            # First in line, the refusal is still the news: wait for a wake before trying again.
            try_at_once = line.waiters > 1
            try:
                async with asyncio.timeout(give_up_at - time.monotonic()):
                    await line.turn.acquire()
            except TimeoutError:
                return await self._last_attempt(attempt, abandoned, refusal, started)
            try:
                while True:
                    woken = try_at_once or await line.wait_freed(give_up_at - time.monotonic())
                    if self._draining:
                        _SHUT_DOWN.observe(time.monotonic() - started)
                        raise _shutting_down()
                    if not woken:  # the wait ran out with no wake since the last refusal
                        return await self._last_attempt(attempt, abandoned, refusal, started)
                    if abandoned is not None and await abandoned():
                        _ABANDONED.observe(time.monotonic() - started)
                        raise refusal
                    line.freed.clear()  # a release from now on wakes the next wait
                    try:
                        result = await attempt()
                    except LockHeld as held:
                        if time.monotonic() >= give_up_at:
                            _TIMED_OUT.observe(time.monotonic() - started)
                            raise
                        refusal = held
                    else:
                        _GRANTED.observe(time.monotonic() - started)
                        return result
                    try_at_once = False
            finally:
                line.turn.release()

    @staticmethod
    async def _last_attempt(
        attempt: Callable[[], Awaitable[T]],
        abandoned: Callable[[], Awaitable[bool]] | None,
        refusal: LockHeld,
        started: float,
    ) -> T:
        """The wait ran out with no wake since the last refusal: decide once more, so the answer is
        the state now (a grant, a holder, or 503 when the database cannot say)."""
        if abandoned is not None and await abandoned():
            _ABANDONED.observe(time.monotonic() - started)
            raise refusal
        try:
            result = await attempt()
        except LockHeld:
            _TIMED_OUT.observe(time.monotonic() - started)
            raise
        _GRANTED.observe(time.monotonic() - started)
        return result

    @contextlib.asynccontextmanager
    async def line(self, resource: str, *, queued: bool = False) -> AsyncIterator[Line]:
        """Join the line for ``resource`` (leaving it on exit); take ``line.turn`` to be the next to try,
        or (``queued``) hold a ticket in ``line.tickets``, woken by the listener and never polled for."""
        line = self._lines.get(resource)
        if line is None:
            line = self._lines[resource] = Line(together=resource.startswith(SHARED_PREFIX))
        line.waiters += 1
        _WAITING.inc()
        if not queued:
            self._follow_while_waited()
        try:
            yield line
        finally:
            _WAITING.dec()
            line.waiters -= 1
            self._leave(resource, line)

    @contextlib.asynccontextmanager
    async def watch(self, resources: Sequence[str]) -> AsyncIterator[asyncio.Event]:
        """An event set each time any of ``resources`` may have come free (a commit of this process, or
        the follower's look), for a waiter that needs them all at once and so takes no turn in any line:
        a waiting reservation (``service/reservation_service.py``). Clear it before each try."""
        event = asyncio.Event()
        joined: list[tuple[str, Line]] = []
        for resource in resources:
            line = self._lines.get(resource)
            if line is None:
                line = self._lines[resource] = Line()
            line.watchers.add(event)
            joined.append((resource, line))
        _WAITING.inc()
        self._follow_while_waited()
        try:
            yield event
        finally:
            _WAITING.dec()
            for resource, line in joined:
                line.watchers.discard(event)
                self._leave(resource, line)

    def _follow_while_waited(self) -> None:
        if self._follower is None:
            self._follower = asyncio.create_task(self._follow(), name="acquire-waiters-follower")

    def _leave(self, resource: str, line: Line) -> None:
        if line.waiters == 0 and not line.watchers and self._lines.get(resource) is line:
            del self._lines[resource]

    def freed(self, resource: str) -> None:
        """This process committed a state in which ``resource`` is free: wake the next in its line (and
        every reservation watching it)."""
        line = self._lines.get(resource)
        if line is not None:
            line.wake()

    async def announce(self, resource: str) -> None:
        """A commit of this process freed ``resource`` while acquires queue for it, perhaps on other
        servers: wake them through the database."""
        if self._queue is not None:
            await self._queue.announce(resource)

    def _wake_all(self) -> None:
        """Wakes may have been missed (the listener's connection died): every waiter looks again."""
        for line in self._lines.values():
            line.wake_all()

    def drain(self) -> None:
        """End every wait now with 503 (the server is shutting down), and refuse to start new ones."""
        self._draining = True
        self._wake_all()

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower

    async def _follow(self) -> None:
        """Ask which awaited locks came free, every ``poll_s`` while anyone waits for one outside the
        queue (in-process turns, reservations); then stop."""
        try:
            while self._lines:
                await asyncio.sleep(self._poll_s)
                # Not the lines whose waiters all hold tickets: the database wakes those.
                resources = [
                    r for r, line in self._lines.items() if line.watchers or line.waiters > len(line.tickets)
                ]
                if not resources:
                    break
                try:
                    freed = await self._notifier.freed(resources)
                except NotifierUnavailable as error:
                    # The waiters still give up at their deadlines, and their own attempts report outages.
                    log.warning("cannot see which awaited locks came free; trying again", error=str(error))
                    continue
                for resource in freed:
                    self.freed(resource)
        finally:
            self._follower = None


def _shutting_down() -> Unavailable:
    return Unavailable("this server is shutting down; retry", retry_after_s=1)
