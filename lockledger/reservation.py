"""Managed reservations: several locks taken all or none, one TTL and one heartbeat for the set.

``async with client.reserve(["zone:A1", "zone:A2"], ttl=30, wait=5) as reservation:`` takes every zone
or none (waiting on the server, holding none meanwhile), each with its own fencing token
(``reservation.fencing_token("zone:A1")``). One renewal every ``ttl / 3`` extends every lease still held
to one deadline; ``await reservation.release("zone:A1")`` ends one as the vehicle leaves that zone; the
block's exit releases the rest. The loss rule is the lease's (``lockledger.lease``): a local deadline
``sent + ttl - margin`` per successful renewal, and ``reservation.lost`` set (``on_lost`` called once)
when it passes or when a renewal is refused. A reservation is lost as a whole: stop using every zone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol, Self

from lockledger.errors import LeaseExpired, LockHeld, LockLost, NotHolder
from lockledger.event import required_datetime

__all__ = ["AsyncReservation", "Reservation", "ReservationInfo"]

log = logging.getLogger("lockledger.reservation")


@dataclass(frozen=True)
class ReservationInfo:
    """A granted or renewed reservation: each resource's fencing token, and the set's one deadline (by the
    database clock) and ``ttl`` (seconds). A release answers with ``released`` and no deadline."""

    reservation_id: str
    owner: str
    tokens: dict[str, int]
    expires_at: datetime | None
    ttl: float | None
    released: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReservationInfo:
        tokens = {lease["resource"]: int(lease["fencing_token"]) for lease in d["leases"]}
        expires_at = required_datetime(d["expires_at"]) if "expires_at" in d else None
        ttl = int(d["ttl_ms"]) / 1000 if "ttl_ms" in d else None
        return cls(d["reservation_id"], d["owner"], tokens, expires_at, ttl, bool(d.get("released", False)))


def leases_field(tokens: Mapping[str, int]) -> list[dict[str, Any]]:
    """The ``leases`` of a renew or release body."""
    return [{"resource": resource, "fencing_token": token} for resource, token in tokens.items()]


class AsyncReservationCommands(Protocol):
    """What an ``AsyncReservation`` sends its commands through: an ``AsyncClient``."""

    async def reserve_set(
        self,
        resources: list[str],
        owner: str | None = None,
        ttl: float | None = None,
        wait: float = 0.0,
        reservation_id: str | None = None,
    ) -> ReservationInfo: ...

    async def renew_reservation(
        self, reservation_id: str, owner: str | None, tokens: Mapping[str, int], ttl: float | None = None
    ) -> ReservationInfo: ...

    async def release_reservation(
        self, reservation_id: str, owner: str | None, tokens: Mapping[str, int]
    ) -> ReservationInfo: ...


class ReservationCommands(Protocol):
    """What a ``Reservation`` sends its commands through: a ``Client``."""

    retry_timeout: float

    def reserve_set(
        self,
        resources: list[str],
        owner: str | None = None,
        ttl: float | None = None,
        wait: float = 0.0,
        reservation_id: str | None = None,
    ) -> ReservationInfo: ...

    def renew_reservation(
        self, reservation_id: str, owner: str | None, tokens: Mapping[str, int], ttl: float | None = None
    ) -> ReservationInfo: ...

    def release_reservation(
        self, reservation_id: str, owner: str | None, tokens: Mapping[str, int]
    ) -> ReservationInfo: ...


class _ReservationState:
    """What both twins share: the leases still held, the local deadline and the loss bookkeeping."""

    def __init__(
        self,
        resources: list[str],
        owner: str | None,
        ttl: float,
        wait: float,
        reservation_id: str | None,
        on_lost: Callable[[LockLost], None] | None,
        safety_margin: float,
    ) -> None:
        if not ttl > 0 or not wait >= 0:  # NaN fails both
            raise ValueError("ttl must be > 0 and wait >= 0 (seconds)")
        if not 0 <= safety_margin < 1:
            raise ValueError("safety_margin is a fraction of ttl in [0, 1)")
        self.resources = list(resources)
        self.owner = owner
        self.ttl = ttl
        self.wait = wait
        self.reservation_id = reservation_id
        self.safety_margin = safety_margin
        self._on_lost = on_lost
        self._lost_reported = False
        self.lost_reason: str | None = None
        self.tokens: dict[str, int] = {}  # the leases still held, resource -> fencing token
        self.expires_at: datetime | None = None
        self.deadline = 0.0  # local monotonic deadline
        self.renewals = 0

    @property
    def renew_interval(self) -> float:
        return self.ttl / 3

    def fencing_token(self, resource: str) -> int:
        """The token of ``resource``'s lease: pass it to every write about that resource."""
        return self.tokens[resource]

    def _granted(self, info: ReservationInfo, sent_at: float) -> None:
        self.reservation_id = info.reservation_id
        self.owner = info.owner
        self.tokens.update(info.tokens)
        self.expires_at = info.expires_at
        self.deadline = max(self.deadline, sent_at + self.ttl * (1 - self.safety_margin))

    def _report_lost(self, reason: str, resource: str | None) -> LockLost | None:
        if self._lost_reported:
            return None
        self._lost_reported = True
        self.lost_reason = reason
        log.warning("reservation lost", extra={"reservation_id": self.reservation_id, "reason": reason})
        resource = resource or next(iter(self.tokens), self.resources[0])
        return LockLost(resource, self.tokens.get(resource, 0), reason)

    def _call_on_lost(self, error: LockLost) -> None:
        if self._on_lost is not None:
            try:
                self._on_lost(error)
            except Exception:  # a broken callback must not kill the watchdog
                log.exception("on_lost callback failed")

    def _lost_error(self) -> LockLost:
        resource = next(iter(self.tokens), self.resources[0])
        return LockLost(resource, self.tokens.get(resource, 0), self.lost_reason or "reservation lost")


class AsyncReservation(_ReservationState):
    """``async with client.reserve([...]) as reservation``: ``reservation.lost`` is an ``asyncio.Event``."""

    def __init__(
        self,
        client: AsyncReservationCommands,
        resources: list[str],
        owner: str | None,
        ttl: float,
        wait: float,
        reservation_id: str | None,
        on_lost: Callable[[LockLost], None] | None,
        safety_margin: float,
    ) -> None:
        super().__init__(resources, owner, ttl, wait, reservation_id, on_lost, safety_margin)
        self._client = client
        self.lost = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def check(self) -> None:
        """Raise ``LockLost`` if the set can no longer be guaranteed; call it before each fenced step."""
        if self.lost.is_set():
            raise self._lost_error()

    def _mark_lost(self, reason: str, resource: str | None = None) -> None:
        error = self._report_lost(reason, resource)
        self.lost.set()
        if error is not None:
            self._call_on_lost(error)

    async def _reserve(self) -> None:
        give_up_at = time.monotonic() + self.wait
        while True:
            sent_at = time.monotonic()
            wait = max(0.0, give_up_at - sent_at)
            try:
                info = await self._client.reserve_set(
                    self.resources, self.owner, self.ttl, wait, self.reservation_id
                )
            except LockHeld:
                if time.monotonic() >= give_up_at:
                    raise
                await asyncio.sleep(min(0.05, max(0.0, give_up_at - time.monotonic())))
                continue
            if time.monotonic() - sent_at > self.ttl / 6:  # granted late in a wait: count from a renewal
                sent_at = time.monotonic()
                info = await self._client.renew_reservation(
                    info.reservation_id, info.owner, info.tokens, self.ttl
                )
            self._granted(info, sent_at)
            return

    async def release(self, resource: str) -> None:
        """End the lease on ``resource`` now (the vehicle has left it); the others stay held."""
        token = self.tokens[resource]
        assert self.reservation_id is not None
        await self._client.release_reservation(self.reservation_id, self.owner, {resource: token})
        self.tokens.pop(resource, None)

    async def _renew_loop(self) -> None:
        while not self.lost.is_set():
            await asyncio.sleep(self.renew_interval)
            if not self.tokens:
                return
            sent_at = time.monotonic()
            assert self.reservation_id is not None
            try:
                async with asyncio.timeout(max(0.0, self.deadline - sent_at)):
                    info = await self._client.renew_reservation(
                        self.reservation_id, self.owner, dict(self.tokens), self.ttl
                    )
            except (LeaseExpired, NotHolder) as error:
                self._mark_lost(f"renewal refused: {error.code}", error.resource)
                return
            except Exception as error:  # transport, 5xx, CircuitOpen, timeout: try again
                log.info("renewal failed, will retry", extra={"error": repr(error)})
                continue
            if not self.lost.is_set():
                self._granted(info, sent_at)
                self.renewals += 1

    async def _watchdog(self) -> None:
        while not self.lost.is_set() and self.tokens:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self._mark_lost("renewals failed until the local deadline passed")
                return
            await asyncio.sleep(remaining)

    async def __aenter__(self) -> Self:
        await self._reserve()
        self._tasks = [asyncio.create_task(self._renew_loop()), asyncio.create_task(self._watchdog())]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.tokens and self.reservation_id is not None:
            try:
                await self._client.release_reservation(self.reservation_id, self.owner, dict(self.tokens))
            except Exception as error:
                # Once lost, releasing is best effort (the leases end on their own), one lease at a time
                # so those still held end now; before that, a failure to release is the caller's business.
                if not self.lost.is_set():
                    raise
                log.info("release after loss failed", extra={"error": repr(error)})
                for resource, token in list(self.tokens.items()):
                    with contextlib.suppress(Exception):
                        await self._client.release_reservation(
                            self.reservation_id, self.owner, {resource: token}
                        )
            self.tokens.clear()
        self.lost.set()  # the set is over either way; late readers must not trust it


class Reservation(_ReservationState):
    """``with client.reserve([...]) as reservation``: renewals and the watchdog run in daemon threads."""

    def __init__(
        self,
        client: ReservationCommands,
        resources: list[str],
        owner: str | None,
        ttl: float,
        wait: float,
        reservation_id: str | None,
        on_lost: Callable[[LockLost], None] | None,
        safety_margin: float,
    ) -> None:
        super().__init__(resources, owner, ttl, wait, reservation_id, on_lost, safety_margin)
        self._client = client
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def check(self) -> None:
        """Raise ``LockLost`` if the set can no longer be guaranteed."""
        if self.lost.is_set():
            raise self._lost_error()

    def _mark_lost(self, reason: str, resource: str | None = None) -> None:
        with self._lock:
            error = self._report_lost(reason, resource)
            self.lost.set()
        if error is not None:
            self._call_on_lost(error)

    def _reserve(self) -> None:
        give_up_at = time.monotonic() + self.wait
        while True:
            sent_at = time.monotonic()
            wait = max(0.0, give_up_at - sent_at)
            try:
                info = self._client.reserve_set(
                    self.resources, self.owner, self.ttl, wait, self.reservation_id
                )
            except LockHeld:
                if time.monotonic() >= give_up_at:
                    raise
                time.sleep(min(0.05, max(0.0, give_up_at - time.monotonic())))
                continue
            if time.monotonic() - sent_at > self.ttl / 6:
                sent_at = time.monotonic()
                info = self._client.renew_reservation(info.reservation_id, info.owner, info.tokens, self.ttl)
            self._granted(info, sent_at)
            return

    def release(self, resource: str) -> None:
        """End the lease on ``resource`` now (the vehicle has left it); the others stay held."""
        with self._lock:
            token = self.tokens[resource]
        assert self.reservation_id is not None
        self._client.release_reservation(self.reservation_id, self.owner, {resource: token})
        with self._lock:
            self.tokens.pop(resource, None)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_interval) and not self.lost.is_set():
            with self._lock:
                tokens = dict(self.tokens)
            if not tokens:
                return
            sent_at = time.monotonic()
            assert self.reservation_id is not None
            try:
                info = self._client.renew_reservation(self.reservation_id, self.owner, tokens, self.ttl)
            except (LeaseExpired, NotHolder) as error:
                self._mark_lost(f"renewal refused: {error.code}", error.resource)
                return
            except Exception as error:  # transport, 5xx, CircuitOpen: try again next tick
                log.info("renewal failed, will retry", extra={"error": repr(error)})
                continue
            with self._lock:
                if not self.lost.is_set():
                    self._granted(info, sent_at)
                    self.renewals += 1

    def _watchdog(self) -> None:
        while not self.lost.is_set():
            with self._lock:
                remaining = self.deadline - time.monotonic()
                held = bool(self.tokens)
            if not held:
                return
            if remaining <= 0:
                self._mark_lost("renewals failed until the local deadline passed")
                return
            if self._stop.wait(remaining):
                return

    def __enter__(self) -> Self:
        self._reserve()
        self._threads = [
            threading.Thread(target=self._renew_loop, name="lockledger-renew-reservation", daemon=True),
            threading.Thread(target=self._watchdog, name="lockledger-watchdog-reservation", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self._client.retry_timeout + 1)
        with self._lock:
            tokens = dict(self.tokens)
        if tokens and self.reservation_id is not None:
            try:
                self._client.release_reservation(self.reservation_id, self.owner, tokens)
            except Exception as error:
                if not self.lost.is_set():
                    raise
                log.info("release after loss failed", extra={"error": repr(error)})
                for resource, token in tokens.items():
                    with contextlib.suppress(Exception):
                        self._client.release_reservation(self.reservation_id, self.owner, {resource: token})
            with self._lock:
                self.tokens.clear()
        self.lost.set()
