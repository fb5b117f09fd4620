"""Managed leases: acquire (optionally waiting), renew in the background, know when the lease is lost.

``ttl``, ``wait`` and every other duration here are seconds (floats). Waiting (``wait=``) happens on the
server: the acquire carries what is left of the wait and is answered when the lock comes free (waiters on
one server process in arrival order) or the wait runs out.

The safety rule. A renewal extends the server deadline to ``db_now + ttl`` where ``db_now`` is at or after
the moment the request left this process, so ``t_sent + ttl`` on the local monotonic clock is never later
than the server deadline. The lease keeps a *local deadline*
``monotonic() taken before sending the last successful acquire/renew + ttl - safety margin`` and a
watchdog sets ``lease.lost`` (and calls ``on_lost`` once) when that deadline passes without a newer
successful renewal, or at once when a renewal answers ``lease_expired``/``not_holder``. So ``lost`` is set
before the server could grant the lock to anyone else; the margin (``safety_margin * ttl``, a fraction,
default 10 %) absorbs clock-rate drift and the time your code needs to notice.

Renewals run every ``ttl / 3``: two consecutive failures still leave a third chance before the deadline.
On exit the lease is released; once it was lost, the release is best effort and its errors are swallowed
(the lease ends on its own, and raising would hide the caller's own exception).

Hand-off (docs/decisions/0047-lease-hand-off.md): ``lease.hand_off(to)`` stops the heartbeats and passes
the lease to the agent ``to``; the lease is then over for this agent (``lost`` is set, ``on_lost`` is not
called, nothing is released at exit). The receiver's ``client.accept_lock(resource)`` is a managed lease
that begins with the acceptance instead of an acquire.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from lockledger.errors import LeaseExpired, LockHeld, LockLost, NotHolder
from lockledger.records import HandedOff, LeaseInfo

__all__ = [
    "AsyncHandOffCommands",
    "AsyncLease",
    "AsyncLeaseCommands",
    "HandOffCommands",
    "Lease",
    "LeaseCommands",
]


class AsyncLeaseCommands(Protocol):
    """What an ``AsyncLease`` sends its commands through: an ``AsyncClient``, or a saga's stand-in."""

    async def acquire(
        self, resource: str, owner: str | None = None, ttl: float | None = None, wait: float = 0.0
    ) -> LeaseInfo: ...

    async def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl: float | None = None
    ) -> LeaseInfo: ...

    async def release(self, resource: str, owner: str | None, fencing_token: int) -> object: ...


class LeaseCommands(Protocol):
    """What a ``Lease`` sends its commands through: a ``Client``."""

    retry_timeout: float

    def acquire(
        self, resource: str, owner: str | None = None, ttl: float | None = None, wait: float = 0.0
    ) -> LeaseInfo: ...

    def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl: float | None = None
    ) -> LeaseInfo: ...

    def release(self, resource: str, owner: str | None, fencing_token: int) -> object: ...


@runtime_checkable
class AsyncHandOffCommands(AsyncLeaseCommands, Protocol):
    """An ``AsyncClient``: what a lease needs to be handed off or to begin by accepting a hand-off."""

    async def accept(
        self, resource: str, owner: str | None = None, ttl: float | None = None
    ) -> LeaseInfo: ...

    async def handoff(
        self,
        resource: str,
        owner: str | None,
        fencing_token: int,
        to: str,
        accept_within: float | None = None,
    ) -> HandedOff: ...


@runtime_checkable
class HandOffCommands(LeaseCommands, Protocol):
    """A ``Client``: what a lease needs to be handed off or to begin by accepting a hand-off."""

    def accept(self, resource: str, owner: str | None = None, ttl: float | None = None) -> LeaseInfo: ...

    def handoff(
        self,
        resource: str,
        owner: str | None,
        fencing_token: int,
        to: str,
        accept_within: float | None = None,
    ) -> HandedOff: ...


def _handing(client: object) -> None:
    """Refuse a hand-off, or an accepting lease, through a client that cannot send one (a saga step's)."""
    if not isinstance(client, AsyncHandOffCommands | HandOffCommands):
        raise TypeError(f"{type(client).__name__} cannot hand a lease off or accept one")


log = logging.getLogger("lockledger.lease")

_BACKOFF_INITIAL_S = 0.05
_BACKOFF_MAX_S = 1.0


def _remaining(give_up_at: float, now: float) -> float:
    """What is left of the caller's ``wait``, for the server to wait with (it wakes on the release, so
    waiting agents neither poll nor stampede)."""
    return max(0.0, give_up_at - now)


def _pause_before_asking_again(sent_at: float, wait: float, refusals: int, give_up_at: float) -> float:
    """0 when the server waited before refusing (it waits at most its ``LOCKLEDGER_MAX_WAIT_MS``): ask
    again at once for what is left. A refusal that came back at once from a server that does not wait
    (a maximum of 0) gets full-jitter exponential backoff instead, so agents do not spin on it. Never
    past ``give_up_at``."""
    now = time.monotonic()
    if now - sent_at >= 0.5 * min(1.0, wait):
        return 0.0
    pause = random.uniform(0, min(_BACKOFF_MAX_S, _BACKOFF_INITIAL_S * 2 ** min(refusals, 10)))
    return min(pause, max(0.0, give_up_at - now))


class _LeaseState:
    """What both twins share: the granted lease, the local deadline and the loss bookkeeping."""

    def __init__(
        self,
        resource: str,
        owner: str | None,
        ttl: float,
        wait: float,
        on_lost: Callable[[LockLost], None] | None,
        safety_margin: float,
        accepting: bool = False,
    ) -> None:
        if not ttl > 0 or not wait >= 0:  # NaN fails both
            raise ValueError("ttl must be > 0 and wait >= 0 (seconds)")
        if not 0 <= safety_margin < 1:
            raise ValueError("safety_margin is a fraction of ttl in [0, 1)")
        self.resource = resource
        self.owner = owner  # None with a token: the server names the owner (the token's principal)
        self.ttl = ttl
        self.wait = wait
        self.safety_margin = safety_margin
        self._on_lost = on_lost
        self._lost_reported = False
        self.lost_reason: str | None = None
        self.fencing_token = 0
        self.expires_at: datetime | None = None
        self.deadline = 0.0  # local monotonic deadline
        self.renewals = 0
        self.accepting = accepting  # begin by accepting a hand-off, not by acquiring
        self.handed_off: HandedOff | None = None  # this agent handed the lease on: it is over here

    @property
    def renew_interval(self) -> float:
        return self.ttl / 3

    def _granted_late(self, sent_at: float) -> bool:
        """Whether the acquire may have been granted long after it was sent (it waited on the server).

        The local deadline counts from when the request left, which is safe only while the grant came
        soon after: a lease granted 20 s into a wait would be believed lost at once. Past a sixth of the
        TTL the lease is renewed straight away, and the deadline counts from the renewal instead.
        """
        return time.monotonic() - sent_at > self.ttl / 6

    def _granted(self, info: LeaseInfo, sent_at: float) -> None:
        self.owner = info.owner
        self.fencing_token = info.fencing_token
        self.expires_at = info.expires_at
        self.deadline = max(self.deadline, sent_at + self.ttl * (1 - self.safety_margin))

    def _report_lost(self, reason: str) -> LockLost | None:
        """The LockLost to hand to ``on_lost``, the first time only."""
        if self._lost_reported:
            return None
        self._lost_reported = True
        self.lost_reason = reason
        log.warning("lease lost", extra={"resource": self.resource, "reason": reason})
        return LockLost(self.resource, self.fencing_token, reason)

    def _call_on_lost(self, error: LockLost) -> None:
        if self._on_lost is not None:
            try:
                self._on_lost(error)
            except Exception:  # a broken callback must not kill the watchdog
                log.exception("on_lost callback failed")

    def _lost_error(self) -> LockLost:
        return LockLost(self.resource, self.fencing_token, self.lost_reason or "lease lost")


class AsyncLease(_LeaseState):
    """``async with client.lock(...) as lease``: ``lease.lost`` is an ``asyncio.Event``."""

    def __init__(
        self,
        client: AsyncLeaseCommands,
        resource: str,
        owner: str | None,
        ttl: float,
        wait: float,
        on_lost: Callable[[LockLost], None] | None,
        safety_margin: float,
        accepting: bool = False,
    ) -> None:
        super().__init__(resource, owner, ttl, wait, on_lost, safety_margin, accepting)
        self._client = client
        self.lost = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def check(self) -> None:
        """Raise ``LockLost`` if the lease can no longer be guaranteed; call it before each fenced step."""
        if self.lost.is_set():
            raise self._lost_error()

    def _mark_lost(self, reason: str) -> None:
        error = self._report_lost(reason)
        self.lost.set()
        if error is not None:
            self._call_on_lost(error)

    async def _acquire(self) -> None:
        if self.accepting:
            client = self._client
            assert isinstance(client, AsyncHandOffCommands)
            sent_at = time.monotonic()
            self._granted(await client.accept(self.resource, self.owner, self.ttl), sent_at)
            return
        give_up_at = time.monotonic() + self.wait
        refusals = 0
        while True:
            sent_at = time.monotonic()
            wait = _remaining(give_up_at, sent_at)
            try:
                info = await self._client.acquire(self.resource, self.owner, self.ttl, wait)
            except LockHeld:
                if time.monotonic() >= give_up_at:
                    raise
                await asyncio.sleep(_pause_before_asking_again(sent_at, wait, refusals, give_up_at))
                refusals += 1
                continue
            if self._granted_late(sent_at):
                sent_at = time.monotonic()
                info = await self._client.renew(self.resource, info.owner, info.fencing_token, self.ttl)
            self._granted(info, sent_at)
            return

    async def _renew_loop(self) -> None:
        while not self.lost.is_set():
            await asyncio.sleep(self.renew_interval)
            sent_at = time.monotonic()
            try:
                # Never wait on a renewal past the local deadline: the watchdog has decided by then.
                async with asyncio.timeout(max(0.0, self.deadline - sent_at)):
                    info = await self._client.renew(self.resource, self.owner, self.fencing_token, self.ttl)
            except (LeaseExpired, NotHolder) as error:
                self._mark_lost(f"renewal refused: {error.code}")
                return
            except Exception as error:  # transport, 5xx, CircuitOpen, timeout: try again
                log.info("renewal failed, will retry", extra={"error": repr(error)})
                continue
            if not self.lost.is_set():
                self._granted(info, sent_at)
                self.renewals += 1

    async def _watchdog(self) -> None:
        """Its own task: a renewal stuck in retries must not delay noticing the deadline."""
        while not self.lost.is_set():
            remaining = self.deadline - time.monotonic()  # re-read: a renewal may have moved it
            if remaining <= 0:
                self._mark_lost("renewals failed until the local deadline passed")
                return
            await asyncio.sleep(remaining)

    async def __aenter__(self) -> Self:
        if self.accepting:
            _handing(self._client)
        await self._acquire()
        self._start()
        return self

    def _start(self) -> None:
        self._tasks = [asyncio.create_task(self._renew_loop()), asyncio.create_task(self._watchdog())]

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def hand_off(self, to: str, accept_within: float | None = None) -> HandedOff:
        """Pass the lease to the agent ``to``, who must accept within ``accept_within`` seconds (the
        server's default TTL if None). Heartbeats stop first; if the hand-off fails they resume (a
        refusal that ends the lease marks it lost) and the error is raised."""
        _handing(self._client)
        self.check()
        client = self._client
        assert isinstance(client, AsyncHandOffCommands)
        await self._stop()
        try:
            handed = await client.handoff(self.resource, self.owner, self.fencing_token, to, accept_within)
        except (LeaseExpired, NotHolder) as error:
            self._mark_lost(f"hand-off refused: {error.code}")
            raise
        except BaseException:
            self._start()
            raise
        self.handed_off = handed
        self.lost.set()  # over for this agent, by its own choice: no on_lost
        return handed

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()
        if self.handed_off is not None:
            return  # the receiver holds it now: nothing of ours to release
        try:
            await self._client.release(self.resource, self.owner, self.fencing_token)
        except Exception as error:
            # Once lost, releasing is best effort (the lease ends on its own); before that, a failure to
            # release is the caller's business.
            if not self.lost.is_set():
                raise
            log.info("release after loss failed", extra={"error": repr(error)})
        self.lost.set()  # the lease is over either way; late readers must not trust it


class Lease(_LeaseState):
    """``with client.lock(...) as lease``: renewals and the watchdog run in one daemon thread."""

    def __init__(
        self,
        client: LeaseCommands,
        resource: str,
        owner: str | None,
        ttl: float,
        wait: float,
        on_lost: Callable[[LockLost], None] | None,
        safety_margin: float,
        accepting: bool = False,
    ) -> None:
        super().__init__(resource, owner, ttl, wait, on_lost, safety_margin, accepting)
        self._client = client
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def check(self) -> None:
        """Raise ``LockLost`` if the lease can no longer be guaranteed."""
        if self.lost.is_set():
            raise self._lost_error()

    def _mark_lost(self, reason: str) -> None:
        with self._lock:
            error = self._report_lost(reason)
            self.lost.set()
        if error is not None:
            self._call_on_lost(error)

    def _acquire(self) -> None:
        if self.accepting:
            client = self._client
            assert isinstance(client, HandOffCommands)
            sent_at = time.monotonic()
            self._granted(client.accept(self.resource, self.owner, self.ttl), sent_at)
            return
        give_up_at = time.monotonic() + self.wait
        refusals = 0
        while True:
            sent_at = time.monotonic()
            wait = _remaining(give_up_at, sent_at)
            try:
                info = self._client.acquire(self.resource, self.owner, self.ttl, wait)
            except LockHeld:
                if time.monotonic() >= give_up_at:
                    raise
                time.sleep(_pause_before_asking_again(sent_at, wait, refusals, give_up_at))
                refusals += 1
                continue
            if self._granted_late(sent_at):
                sent_at = time.monotonic()
                info = self._client.renew(self.resource, info.owner, info.fencing_token, self.ttl)
            self._granted(info, sent_at)
            return

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_interval) and not self.lost.is_set():
            sent_at = time.monotonic()
            try:
                info = self._client.renew(self.resource, self.owner, self.fencing_token, self.ttl)
            except (LeaseExpired, NotHolder) as error:
                self._mark_lost(f"renewal refused: {error.code}")
                return
            except Exception as error:  # transport, 5xx, CircuitOpen: try again next tick
                log.info("renewal failed, will retry", extra={"error": repr(error)})
                continue
            with self._lock:
                if not self.lost.is_set():
                    self._granted(info, sent_at)
                    self.renewals += 1

    def _watchdog(self) -> None:
        """A separate thread: a renewal stuck in retries must not delay noticing the deadline."""
        while not self.lost.is_set():
            with self._lock:
                remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self._mark_lost("renewals failed until the local deadline passed")
                return
            if self._stop.wait(remaining):
                return

    def __enter__(self) -> Self:
        if self.accepting:
            _handing(self._client)
        self._acquire()
        self._start()
        return self

    def _start(self) -> None:
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._renew_loop, name=f"lockledger-renew-{self.resource}", daemon=True),
            threading.Thread(target=self._watchdog, name=f"lockledger-watchdog-{self.resource}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _halt(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self._client.retry_timeout + 1)

    def hand_off(self, to: str, accept_within: float | None = None) -> HandedOff:
        """Pass the lease to the agent ``to``, who must accept within ``accept_within`` seconds (the
        server's default TTL if None). Heartbeats stop first; if the hand-off fails they resume (a
        refusal that ends the lease marks it lost) and the error is raised."""
        _handing(self._client)
        self.check()
        client = self._client
        assert isinstance(client, HandOffCommands)
        self._halt()
        try:
            handed = client.handoff(self.resource, self.owner, self.fencing_token, to, accept_within)
        except (LeaseExpired, NotHolder) as error:
            self._mark_lost(f"hand-off refused: {error.code}")
            raise
        except BaseException:
            self._start()
            raise
        with self._lock:
            self.handed_off = handed
            self.lost.set()  # over for this agent, by its own choice: no on_lost
        return handed

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._halt()
        if self.handed_off is not None:
            return  # the receiver holds it now: nothing of ours to release
        try:
            self._client.release(self.resource, self.owner, self.fencing_token)
        except Exception as error:
            if not self.lost.is_set():
                raise
            log.info("release after loss failed", extra={"error": repr(error)})
        self.lost.set()
