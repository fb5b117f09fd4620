"""Acquires that wait for a held lock to come free (``wait_ms``), and what wakes them.

An agent that wants a zone another agent holds would otherwise poll: every poll is a request, a read
and a 409, and the first poll after the release wins by luck, not by order. A waiting acquire instead
stays with the server, which tries again only when the lock may have come free:

- at once when this process committed the release, expiry or force-release (``freed``);
- otherwise when the follower sees it: while anyone in this process waits, every ``poll_s`` it asks the
  ``Notifier`` port (``service/ports.py``; in PostgreSQL ``service/notifier.py``) which of the awaited
  locks are free or past their deadline by the store's clock. That covers releases through other server
  processes and leases that lapsed (the retried acquire itself appends the expiry; it need not wait for
  the reaper), and nothing is asked when nobody waits (DESIGN: no NOTIFY in the append).

The waiters on one lock in one process take turns in arrival order (``asyncio.Lock`` is FIFO): only the
first tries again on a wake, so a release hands the lock to the longest waiter here instead of waking
every waiter to race. Across processes the database decides who wins, as for any two acquires.
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
from service.errors import Unavailable
from service.ports import Notifier, NotifierUnavailable

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


class Line:
    """The waiters on one lock in this process; the one holding ``turn`` is the next to try. Watchers
    (waiting reservations, ``Waiters.watch``) take no turn: each has its own event, set on every wake."""

    __slots__ = ("freed", "turn", "waiters", "watchers")

    def __init__(self) -> None:
        self.turn = asyncio.Lock()
        self.freed = asyncio.Event()
        self.waiters = 0
        self.watchers: set[asyncio.Event] = set()

    def wake(self) -> None:
        self.freed.set()
        for watcher in self.watchers:
            watcher.set()

    async def wait_freed(self, timeout_s: float) -> bool:
        """Whether the lock may have come free within ``timeout_s``."""
        if timeout_s <= 0:
            return self.freed.is_set()
        try:
            async with asyncio.timeout(timeout_s):
                await self.freed.wait()
        except TimeoutError:
            return False
        return True


class Waiters:
    def __init__(self, notifier: Notifier, *, poll_s: float) -> None:
        self._notifier = notifier
        self._poll_s = poll_s
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
        attempt: Callable[[], Awaitable[T]],
        wait_s: float,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> T:
        """``attempt()``, and again each time ``resource`` may have come free, until it is not refused
        with ``LockHeld`` or ``wait_s`` has passed. The answer at the deadline is a last attempt, not the
        refusal remembered from the last wake: it may still be granted, and a database that went away
        meanwhile is reported as such (503), not as a holder it can no longer vouch for. ``abandoned``
        says whether the caller has gone (its connection closed): it is asked before each new attempt,
        so a lock is never taken for a client that stopped waiting."""
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
    async def line(self, resource: str) -> AsyncIterator[Line]:
        """Join the line for ``resource`` (leaving it on exit); take ``line.turn`` to be the next to try."""
        line = self._lines.get(resource)
        if line is None:
            line = self._lines[resource] = Line()
        line.waiters += 1
        _WAITING.inc()
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

    def drain(self) -> None:
        """End every wait now with 503 (the server is shutting down), and refuse to start new ones."""
        self._draining = True
        for line in self._lines.values():
            line.wake()

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower

    async def _follow(self) -> None:
        """Ask which awaited locks came free, every ``poll_s`` while anyone waits; then stop."""
        try:
            while self._lines:
                await asyncio.sleep(self._poll_s)
                resources = list(self._lines)
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
