"""Sagas: a few steps, each under its own locks, that either all complete or are undone in reverse.

A saga *definition* (``define``) names the steps up front: each with the locks it takes (templates such as
``"pallet:{pallet}"``, filled from the saga's ``params``), its ``action``, its ``compensate``, a ``timeout``
(seconds, around the lock wait and the action) and whether it ``keep``s its locks for later steps. The
server is told the steps when the saga starts (``POST /v1/sagas``) and records every transition in the
saga's own stream, so an orchestrator that crashed can be replaced by one that reads only that log
(``recover_sagas``).

Why the keys look the way they do. Every lock command of a saga carries ``X-Saga-ID``/``X-Saga-Step`` and an
Idempotency-Key derived from the saga, the step, the resource and the *attempt* (the how-manieth lease this
step takes on that resource). An acquire whose answer was lost, or that a new orchestrator repeats after a
crash, replays the lease already granted instead of taking a second one; a replayed lease is renewed
before it is trusted, and one that has ended meanwhile moves the step to its next attempt.

While it runs a saga, the orchestrator heartbeats the saga's own lease (``lease`` seconds, default 30;
``lockledger.saga_heartbeat``); if the heartbeats stop, the server compensates the saga or, when nobody
finishes it, marks it ``stuck``, so no saga stays running without an orchestrator.

Actions and compensations may be coroutine functions or plain functions (run in a thread, so heartbeats
keep running; a plain function cannot be interrupted, so on a timeout the step fails once it returns).
An action receives a ``StepContext`` and returns a JSON object (a ``dict``) or None: that is recorded as the
step's ``result`` (at most 4 KiB) and is what its compensation is called with, by this orchestrator or,
after a crash, by another. Compensations must therefore be idempotent: one that started but did not
report completion before a crash is called again. Importing this module pulls in no server code.

A step with ``route=True`` takes its locks as one reservation (``lockledger.reservation``): all of them or
none, waiting (up to its ``timeout``) while any is held without holding the others, one heartbeat for the
set. The server names the reservation (the step's ``reservation_id``), and its grants are one transaction
in the log, each with the saga and the step in its metadata, as a saga's single locks are.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import json
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypeVar

from lockledger.errors import (
    Forbidden,
    LeaseExpired,
    LockHeld,
    LockLedgerError,
    NotFound,
    NotHolder,
    ValidationError,
    parse_datetime,
)
from lockledger.lease import AsyncLease
from lockledger.records import LeaseInfo, Reply
from lockledger.reservation import AsyncReservation, ReservationInfo, leases_field
from lockledger.saga_heartbeat import SagaHeartbeat
from lockledger.wire import acquire_body, lock_path, owner_field, release_body, renew_body, ttl_field

__all__ = [
    "AsyncSaga",
    "BlockingSagaClient",
    "Saga",
    "SagaClient",
    "SagaDefinition",
    "SagaFailed",
    "SagaStuck",
    "SagaView",
    "Step",
    "StepContext",
    "StepView",
    "TimelineEvent",
    "define",
    "get_saga",
    "list_sagas",
    "registry",
]

log = logging.getLogger("lockledger.saga")

Result = dict[str, Any] | None
Action = Callable[["StepContext"], Any]  # returns a Result, or an awaitable of one
Compensation = Callable[[Result], Any]  # returns None, or an awaitable
Policy = Literal["compensate", "forward"]
T = TypeVar("T")

# The server's rules, kept here as the SDK imports no server code.
_SAGA_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,100}")
_MAX_STEPS = 32
_MAX_RESULT_BYTES = 4096
_MAX_KEY_LENGTH = 255
COMPENSATION_ATTEMPTS = 5  # the server makes the saga ``stuck`` at the 5th failure of one compensation
_BACKOFF_INITIAL_S = 0.2
_BACKOFF_MAX_S = 5.0
DEFAULT_LEASE_S = 30.0


def _refused(detail: str) -> ValidationError:
    return ValidationError(0, {"code": "validation_error", "detail": detail})


# --- definitions ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of a definition. ``locks`` are resources or templates (``"zone:{zone}"``); ``action(ctx)``
    returns the step's result (a dict or None), ``compensate(result)`` undoes it; ``ttl`` is the lease
    length of its locks (fixed per step: a repeated acquire must be the same request to replay);
    ``route`` takes the locks as one reservation, all or none (each lock named once)."""

    name: str
    locks: Sequence[str] = ()
    action: Action | None = None
    compensate: Compensation | None = None
    timeout: float = 30.0
    keep: bool = False
    ttl: float = 30.0
    route: bool = False


@dataclass(frozen=True)
class SagaDefinition:
    """The steps of a kind of saga, in order, and what recovery does with an unfinished one (``policy``:
    ``"compensate"`` undoes the completed steps, ``"forward"`` runs the remaining ones)."""

    name: str
    steps: tuple[Step, ...]
    policy: Policy = "compensate"

    def step(self, name: str) -> Step:
        for step in self.steps:
            if step.name == name:
                return step
        raise _refused(f"saga {self.name!r} has no step {name!r}")

    def resolve(self, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The steps as ``POST /v1/sagas`` wants them: names and concrete resources."""
        try:
            return [
                {
                    "name": s.name,
                    "locks": [lock.format(**params) for lock in s.locks],
                    **({"route": True} if s.route else {}),
                }
                for s in self.steps
            ]
        except (KeyError, IndexError) as error:
            raise _refused(f"saga {self.name!r}: a lock template needs the param {error}") from error


_REGISTRY: dict[str, SagaDefinition] = {}
_REGISTRY_LOCK = threading.Lock()


def define(
    name: str, steps: Sequence[Step], *, policy: Policy = "compensate", register: bool = True
) -> SagaDefinition:
    """A saga definition (1-32 steps with unique names), registered under ``name`` for ``client.saga``
    and ``recover_sagas`` unless ``register=False``."""
    names = [s.name for s in steps]
    if not 1 <= len(steps) <= _MAX_STEPS or len(set(names)) != len(names):
        raise _refused(f"a saga has 1-{_MAX_STEPS} steps with unique names, not {names}")
    for step_name in names:
        _check_saga_id(step_name, "step name")
    if policy not in ("compensate", "forward"):
        raise _refused(f"policy is 'compensate' or 'forward', not {policy!r}")
    for step in steps:
        if not step.timeout > 0 or not step.ttl > 0:
            raise _refused(f"step {step.name!r}: timeout and ttl are seconds > 0")
        if step.route and (not step.locks or len(set(step.locks)) != len(step.locks)):
            raise _refused(f"route step {step.name!r} takes one or more locks, each named once")
    definition = SagaDefinition(name, tuple(steps), policy)
    if register:
        with _REGISTRY_LOCK:
            _REGISTRY[name] = definition
    return definition


def registry() -> dict[str, SagaDefinition]:
    """A copy of the registered definitions, by name."""
    with _REGISTRY_LOCK:
        return dict(_REGISTRY)


def _definition(definition: SagaDefinition | str | None) -> SagaDefinition:
    if isinstance(definition, SagaDefinition):
        return definition
    if definition is None:
        raise _refused("a saga needs its definition, or the name of a registered one (name=...)")
    found = registry().get(definition)
    if found is None:
        raise _refused(f"no saga definition named {definition!r} (lockledger.saga.define)")
    return found


# --- the server's view of a saga -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepView:
    name: str
    locks: list[str]
    status: str  # pending, running, completed, failed, compensating, compensated
    result: Result
    error: str | None
    compensation_failures: int
    route: bool = False  # the locks are taken as one reservation
    reservation_id: str | None = None  # a route step's reservation, as the server names it

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepView:
        return cls(
            d["name"], list(d.get("locks") or []), d["status"], d.get("result"), d.get("error"),
            int(d.get("compensation_failures") or 0), bool(d.get("route", False)), d.get("reservation_id"),
        )  # fmt: skip


@dataclass(frozen=True)
class TimelineEvent:
    position: int
    version: int
    type: str
    data: dict[str, Any]
    recorded_at: datetime

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TimelineEvent:
        recorded_at = parse_datetime(d["recorded_at"])
        assert recorded_at is not None
        return cls(int(d["position"]), int(d["version"]), d["type"], d.get("data") or {}, recorded_at)


@dataclass(frozen=True)
class SagaView:
    """``GET /v1/sagas/{id}``: ``status`` is running, compensating, completed, aborted or stuck; the
    timeline only when read one saga at a time."""

    saga_id: str
    name: str
    owner: str
    policy: str
    status: str
    reason: str | None
    steps: list[StepView]
    version: int
    started_at: datetime | None
    updated_at: datetime | None
    timeline: list[TimelineEvent] = field(default_factory=list)
    lease_ms: int | None = None  # the saga's own lease; None for one started without
    lease_expires_at: datetime | None = None  # its deadline by the server's clock; None once ended
    lease_lapsed_at: datetime | None = None  # when it last lapsed with no heartbeat since

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SagaView:
        return cls(
            d["saga_id"], d["name"], d["owner"], d.get("policy", "compensate"), d["status"], d.get("reason"),
            [StepView.from_json(s) for s in d["steps"]], int(d["version"]),
            parse_datetime(d.get("started_at")), parse_datetime(d.get("updated_at")),
            [TimelineEvent.from_json(e) for e in d.get("timeline") or []],
            d.get("lease_ms"), parse_datetime(d.get("lease_expires_at")),
            parse_datetime(d.get("lease_lapsed_at")),
        )  # fmt: skip

    def step(self, name: str) -> StepView:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(name)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "aborted", "stuck")


class SagaFailed(Exception):
    """A step failed (its exception, or ``TimeoutError``, is the ``__cause__``); the completed steps were
    compensated and the saga's locks released. ``view`` is the saga as the server last answered."""

    def __init__(self, saga_id: str, step: str | None, reason: str, view: SagaView | None) -> None:
        super().__init__(f"saga {saga_id} failed at step {step}: {reason}")
        self.saga_id = saga_id
        self.step = step
        self.reason = reason
        self.view = view


class SagaStuck(SagaFailed):
    """A compensation failed ``COMPENSATION_ATTEMPTS`` times: the saga is ``stuck`` and needs a human."""


@dataclass
class StepContext:
    """What an action gets: the saga, the step, the leases the saga holds now (by resource), the results
    of the steps completed so far, and the reservations of route steps the saga holds now (by step)."""

    saga_id: str
    step: str
    leases: dict[str, AsyncLease]
    results: dict[str, Result]
    params: dict[str, Any]
    reservations: dict[str, AsyncReservation] = field(default_factory=dict)

    def fencing_token(self, resource: str) -> int:
        """The fencing token to send downstream with every write to ``resource``."""
        if resource in self.leases:
            return self.leases[resource].fencing_token
        for reservation in self.reservations.values():
            if resource in reservation.tokens:
                return reservation.fencing_token(resource)
        raise KeyError(resource)


# --- HTTP: the client's public request, with the saga's headers and keys ------------------------------------


def _key(*parts: str) -> str:
    """A readable Idempotency-Key; hashed when the parts would make it longer than the server takes."""
    key = ":".join(["saga", *parts])
    if len(key) <= _MAX_KEY_LENGTH:
        return key
    return f"saga:{hashlib.sha256(key.encode()).hexdigest()}"


class SagaClient(Protocol):
    """What sagas need of a client: its agent and its public ``request`` (``AsyncClient`` has both)."""

    @property
    def agent_id(self) -> str | None: ...

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        wait: float = 0.0,
    ) -> Reply: ...


class BlockingSagaClient(Protocol):
    """The blocking ``SagaClient`` (``Client`` is one)."""

    @property
    def agent_id(self) -> str | None: ...

    def request(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        wait: float = 0.0,
    ) -> Reply: ...


async def _call(
    client: SagaClient,
    method: str,
    path: str,
    *,
    json: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    wait: float = 0.0,
) -> tuple[Any, bool]:
    """The client's ``request`` with the saga's headers and chosen key: the answer, and whether it was a
    replay of a stored one."""
    reply = await client.request(
        method, path, json=json, params=params, headers=headers, idempotency_key=key, wait=wait
    )
    return reply.data, reply.replayed


async def get_saga(client: SagaClient, saga_id: str) -> SagaView:
    """``GET /v1/sagas/{id}``: the saga with its timeline; ``NotFound`` if there is none."""
    data, _ = await _call(client, "GET", f"/v1/sagas/{_check_saga_id(saga_id)}")
    return SagaView.from_json(data)


async def list_sagas(client: SagaClient, status: str, owner: str | None = None) -> list[SagaView]:
    """``GET /v1/sagas?status=&owner=``, every page: the sagas the caller may see in ``status``."""
    return await _list_sagas(client, status, owner)


async def _list_sagas(client: SagaClient, status: str, owner: str | None) -> list[SagaView]:
    found: list[SagaView] = []
    cursor: str | None = None
    while True:
        query = {"status": status, "owner": owner, "cursor": cursor, "limit": 100}
        params = {k: v for k, v in query.items() if v is not None}
        data, _ = await _call(client, "GET", "/v1/sagas", params=params)
        found += [SagaView.from_json(item) for item in data["items"]]
        cursor = data.get("next_cursor")
        if cursor is None:
            return found


def _check_saga_id(saga_id: str, what: str = "saga id") -> str:
    """A saga id or step name (one URL path segment) the server could accept, before anything is sent."""
    if not isinstance(saga_id, str) or not _SAGA_ID_RE.fullmatch(saga_id) or not saga_id.strip("."):
        raise _refused(f"invalid {what} {saga_id!r:.80}: 1-100 characters of A-Z, a-z, 0-9 and . _ : -")
    return saga_id


class _SagaLockCalls:
    """Stands in for the client in one saga lease: the same lock commands, sent with the saga's headers
    and keys derived from (saga, step, attempt, resource) rather than random ones."""

    def __init__(self, client: SagaClient, saga_id: str, step: str, resource: str) -> None:
        self.client = client
        self.saga_id = saga_id
        self.step = step
        self.resource = resource
        self.attempt = 1
        self.replayed = False
        self.headers = {"X-Saga-ID": saga_id, "X-Saga-Step": step}

    def _key(self, command: str, *extra: str) -> str:
        return _key(self.saga_id, self.step, str(self.attempt), command, self.resource, *extra)

    async def acquire(
        self, resource: str, owner: str | None = None, ttl: float | None = None, wait: float = 0.0
    ) -> LeaseInfo:
        body = acquire_body(owner, ttl, wait)
        data, self.replayed = await _call(
            self.client, "POST", lock_path(resource, "/acquire"), json=body, key=self._key("acquire"),
            headers=self.headers, wait=wait,
        )  # fmt: skip
        return LeaseInfo.from_json(data)

    async def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl: float | None = None
    ) -> LeaseInfo:
        body = renew_body(owner, fencing_token, ttl)
        key = self._key("renew", str(fencing_token), uuid.uuid4().hex[:12])  # each renewal a new request
        data, _ = await _call(
            self.client, "POST", lock_path(resource, "/renew"), json=body, key=key, headers=self.headers
        )
        return LeaseInfo.from_json(data)

    async def release(self, resource: str, owner: str | None, fencing_token: int) -> Any:
        body = release_body(owner, fencing_token)
        key = self._key("release", str(fencing_token))
        data, _ = await _call(
            self.client, "POST", lock_path(resource, "/release"), json=body, key=key, headers=self.headers
        )
        return data


class _SagaLease(AsyncLease):
    """The SDK's managed lease (heartbeats, loss detection) taken through ``_SagaLockCalls``.

    An acquire answered from a stored response is a lease an earlier run of this step took: it is ours
    only if it can still be renewed; if it cannot, the step's next attempt asks for a new lease.
    """

    def __init__(
        self, client: SagaClient, saga_id: str, step: Step, resource: str, owner: str | None, wait: float
    ) -> None:
        self.calls = _SagaLockCalls(client, saga_id, step.name, resource)
        super().__init__(self.calls, resource, owner, step.ttl, wait, None, 0.1)
        self.step = step.name

    async def _acquire(self) -> None:
        while True:
            self.deadline = 0.0
            await super()._acquire()
            if not self.calls.replayed:
                return
            sent_at = time.monotonic()
            try:
                info = await self.calls.renew(self.resource, self.owner, self.fencing_token, self.ttl)
            except (LeaseExpired, NotHolder):
                self.calls.attempt += 1
                continue
            self.deadline = 0.0
            self._granted(info, sent_at)
            return

    async def close(self) -> None:
        """Release; errors are logged, not raised (the lease ends on its own at its deadline)."""
        try:
            await self.__aexit__(None, None, None)
        except Exception as error:
            log.warning("saga lease release failed", extra={"resource": self.resource, "error": repr(error)})


class _SagaReservationCalls:
    """Stands in for the client in a route step's reservation: the same reservation commands, sent with
    the saga's headers and keys derived from (saga, step, attempt) rather than random ones."""

    def __init__(self, client: SagaClient, saga_id: str, step: str) -> None:
        self.client = client
        self.saga_id = saga_id
        self.step = step
        self.attempt = 1
        self.replayed = False
        self.headers = {"X-Saga-ID": saga_id, "X-Saga-Step": step}

    def _key(self, command: str, *extra: str) -> str:
        return _key(self.saga_id, self.step, str(self.attempt), command, *extra)

    async def reserve_set(
        self,
        resources: list[str],
        owner: str | None = None,
        ttl: float | None = None,
        wait: float = 0.0,
        reservation_id: str | None = None,
    ) -> ReservationInfo:
        body = {"resources": resources, **acquire_body(owner, ttl, wait), "reservation_id": reservation_id}
        data, self.replayed = await _call(
            self.client, "POST", "/v1/reservations", json=body, key=self._key("reserve"),
            headers=self.headers, wait=wait,
        )  # fmt: skip
        return ReservationInfo.from_json(data)

    async def renew_reservation(
        self, reservation_id: str, owner: str | None, tokens: Mapping[str, int], ttl: float | None = None
    ) -> ReservationInfo:
        body = {**owner_field(owner), "leases": leases_field(tokens), **ttl_field(ttl)}
        key = self._key("renew", uuid.uuid4().hex[:12])  # each renewal a new request
        path = f"/v1/reservations/{reservation_id}/renew"
        data, _ = await _call(self.client, "POST", path, json=body, key=key, headers=self.headers)
        return ReservationInfo.from_json(data)

    async def release_reservation(
        self, reservation_id: str, owner: str | None, tokens: Mapping[str, int]
    ) -> ReservationInfo:
        body = {**owner_field(owner), "leases": leases_field(tokens)}
        key = self._key("release", *(f"{resource}={token}" for resource, token in sorted(tokens.items())))
        path = f"/v1/reservations/{reservation_id}/release"
        data, _ = await _call(self.client, "POST", path, json=body, key=key, headers=self.headers)
        return ReservationInfo.from_json(data)


class _SagaRoute(AsyncReservation):
    """A route step's locks as one managed reservation (one heartbeat, loss detection) taken through
    ``_SagaReservationCalls``. As with ``_SagaLease``, a reserve answered from a stored response is a set
    an earlier run of this step took: it is ours only if it can still be renewed whole; if it cannot, the
    step's next attempt asks for a new set."""

    def __init__(
        self,
        client: SagaClient,
        saga_id: str,
        step: Step,
        resources: Sequence[str],
        reservation_id: str,
        owner: str | None,
        wait: float,
    ) -> None:
        self.calls = _SagaReservationCalls(client, saga_id, step.name)
        super().__init__(self.calls, list(resources), owner, step.ttl, wait, reservation_id, None, 0.1)
        self.step = step.name

    async def _reserve(self) -> None:
        while True:
            self.deadline = 0.0
            await super()._reserve()
            if not self.calls.replayed:
                return
            sent_at = time.monotonic()
            assert self.reservation_id is not None
            try:
                info = await self.calls.renew_reservation(
                    self.reservation_id, self.owner, dict(self.tokens), self.ttl
                )
            except (LeaseExpired, NotHolder):
                self.tokens.clear()
                self.calls.attempt += 1
                continue
            self.deadline = 0.0
            self._granted(info, sent_at)
            return

    async def close(self) -> None:
        """Release the set; errors are logged, not raised (the leases end on their own at their deadline)."""
        try:
            await self.__aexit__(None, None, None)
        except Exception as error:
            log.warning("saga route release failed", extra={"step": self.step, "error": repr(error)})


async def _run(fn: Callable[[Any], Any], arg: Any) -> Any:
    """Call ``fn(arg)``: awaited if it is a coroutine function, else in a thread. A thread cannot be
    stopped: when the caller is cancelled (a timeout), this waits for it to return, then re-raises."""
    if inspect.iscoroutinefunction(fn):
        return await fn(arg)
    future = asyncio.ensure_future(asyncio.to_thread(fn, arg))
    try:
        result = await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await future
        raise
    if inspect.isawaitable(result):
        result = await result
    return result


def _checked_result(step: str, result: Any) -> Result:
    if result is not None and not isinstance(result, dict):
        raise TypeError(f"step {step!r}: an action returns a dict (JSON object) or None, not {type(result)}")
    if result is not None and len(json.dumps(result).encode()) > _MAX_RESULT_BYTES:
        raise ValueError(f"step {step!r}: the result is over {_MAX_RESULT_BYTES} bytes as JSON")
    return result


def _reason(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timeout"
    return f"{type(error).__name__}: {error}"[:500]


# --- the orchestrator ----------------------------------------------------------------------------------


class AsyncSaga:
    """``async with client.saga(saga_id, definition, params=...) as saga:``, then ``await saga.step(name)``
    for each step in order. Leaving the block normally completes the saga; a failed step (or an exception
    in the block) compensates the completed steps in reverse and raises ``SagaFailed``. Inside the block
    (and while ``recover`` runs) the saga's ``lease`` (seconds) is heartbeated every third of it."""

    def __init__(
        self,
        client: SagaClient,
        saga_id: str | None,
        definition: SagaDefinition | str | None,
        params: Mapping[str, Any] | None = None,
        owner: str | None = None,
        lease: float = DEFAULT_LEASE_S,
    ) -> None:
        if not lease > 0:
            raise _refused(f"lease is seconds > 0, not {lease!r}")
        self.client = client
        self.lease = lease
        self._heartbeat: SagaHeartbeat | None = None
        self.saga_id = _check_saga_id(saga_id) if saga_id is not None else None
        self.definition = _definition(definition)
        self.params = dict(params or {})
        self.owner = owner or client.agent_id  # None with a token: the server names the token's principal
        self.view: SagaView | None = None
        self.results: dict[str, Result] = {}
        self.leases: dict[str, _SagaLease] = {}  # every lock the saga holds now, by resource
        self.routes: dict[str, _SagaRoute] = {}  # every route step's reservation it holds now, by step
        self._released: set[tuple[str, str]] = set()  # (step, resource) given back by this orchestrator
        self._compensations: dict[str, Compensation | None] = {}
        self._failed = False

    @classmethod
    async def recover_all(
        cls,
        client: SagaClient,
        definitions: Iterable[SagaDefinition] | Mapping[str, SagaDefinition] | None = None,
        owner: str | None = None,
    ) -> list[SagaView]:
        """Every unfinished saga of ``owner`` finished (``recover_sagas``; ``AsyncClient.recover_sagas``)."""
        return await recover_sagas(client, definitions, owner)

    @property
    def id(self) -> str:
        assert self.saga_id is not None, "the saga has not started"
        return self.saga_id

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> SagaView:
        data, _ = await _call(self.client, "POST", f"/v1/sagas/{self.id}{path}", json=body or {})
        self.view = SagaView.from_json(data)
        return self.view

    async def start(self) -> SagaView:
        """``POST /v1/sagas``: create it, or find it as it is (the same id and definition again)."""
        body: dict[str, Any] = {
            "name": self.definition.name,
            "steps": self.definition.resolve(self.params),
            "policy": self.definition.policy,
            "lease_ms": round(self.lease * 1000),
            **({"saga_id": self.saga_id} if self.saga_id is not None else {}),
            **({"owner": self.owner} if self.owner is not None else {}),
        }
        data, _ = await _call(self.client, "POST", "/v1/sagas", json=body, key=None)
        self.view = SagaView.from_json(data)
        self.saga_id = self.view.saga_id
        return self.view

    async def __aenter__(self) -> Self:
        view = await self.start()
        if view.status != "running":
            raise LockLedgerError(
                409, {"code": "saga_conflict", "detail": f"saga {view.saga_id} is {view.status}"}
            )
        self.results = {s.name: s.result for s in view.steps if s.status == "completed"}
        self._beat_while_running(view)
        return self

    def _beat_while_running(self, view: SagaView) -> None:
        """Heartbeat the saga's lease (as the server knows it) until ``_stop_beating``."""
        lease = view.lease_ms / 1000 if view.lease_ms else self.lease
        self._heartbeat = SagaHeartbeat(view.saga_id, lease, self._send_heartbeat)
        self._heartbeat.start()

    async def _send_heartbeat(self) -> None:
        await _call(self.client, "POST", f"/v1/sagas/{self.id}/heartbeat", json={})

    async def _stop_beating(self) -> None:
        if self._heartbeat is not None:
            await self._heartbeat.stop()

    def _spec(
        self,
        name: str,
        lock: str | None,
        locks: Sequence[str] | None,
        action: Action | None,
        compensate: Compensation | None,
        timeout: float | None,
        keep: bool | None,
    ) -> tuple[Step, list[str]]:
        """The definition's step with the call's overrides, and its resources as the server knows them."""
        base = self.definition.step(name)
        assert self.view is not None
        known = self.view.step(name).locks
        wanted = [lock] if lock is not None else list(locks) if locks is not None else known
        if sorted(wanted) != sorted(known):
            raise _refused(f"step {name!r} takes {known} (its definition), not {wanted}")
        step = Step(
            name, base.locks, action or base.action, compensate or base.compensate,
            base.timeout if timeout is None else timeout, base.keep if keep is None else keep, base.ttl,
            base.route,
        )  # fmt: skip
        if not step.timeout > 0:
            raise _refused(f"step {name!r}: timeout is seconds > 0")
        return step, known

    async def step(
        self,
        name: str,
        *,
        lock: str | None = None,
        locks: Sequence[str] | None = None,
        action: Action | None = None,
        compensate: Compensation | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the step's own, applied with asyncio.timeout
        keep: bool | None = None,
    ) -> Result:
        """Run one step: take its locks (waiting up to ``timeout``), run ``action``, record its result.

        Arguments left out come from the definition. A step the server already shows completed (the
        saga was resumed) is not run again: its recorded result is returned.
        """
        step, resources = self._spec(name, lock, locks, action, compensate, timeout, keep)
        if step.action is None:
            raise _refused(f"step {name!r} has no action")
        self._compensations[name] = step.compensate
        assert self.view is not None
        if self.view.step(name).status == "completed":
            if step.keep:
                await self._take(step, resources, wait=step.timeout)
            return self.results.get(name)
        return await self._run_step(step, resources)

    async def _run_step(self, step: Step, resources: list[str]) -> Result:
        await self._post(f"/steps/{step.name}/start")
        assert step.action is not None
        try:
            async with asyncio.timeout(step.timeout):
                # The lease would wait a little longer: the step's timeout decides, as a TimeoutError.
                await self._take(step, resources, wait=step.timeout + 1)
                self._check_leases()
                context = StepContext(
                    self.id, step.name, dict(self.leases), dict(self.results), self.params, dict(self.routes)
                )
                result = _checked_result(step.name, await _run(step.action, context))
                self._check_leases()
        except Exception as error:
            await self._fail(step.name, error)
            raise SagaFailed(self.id, step.name, _reason(error), self.view) from error
        await self._post(f"/steps/{step.name}/complete", {"result": result})
        self.results[step.name] = result
        if not step.keep:
            await self._release(lambda taken: taken == step.name)
        return result

    async def _take(self, step: Step, resources: Iterable[str], wait: float) -> None:
        """Take (or take back, after a crash) the step's locks the saga does not hold yet: a route step's
        as the one reservation the server named for it, any other's one by one."""
        assert self.view is not None
        reservation_id = self.view.step(step.name).reservation_id
        if reservation_id is not None:
            if step.name not in self.routes:
                route = _SagaRoute(
                    self.client, self.id, step, list(resources), reservation_id, self.owner, wait
                )
                await route.__aenter__()
                self.routes[step.name] = route
            return
        for resource in resources:
            if resource in self.leases:
                continue
            lease = _SagaLease(self.client, self.id, step, resource, self.owner, wait)
            await lease.__aenter__()
            self.leases[resource] = lease

    def _check_leases(self) -> None:
        for lease in self.leases.values():
            lease.check()
        for route in self.routes.values():
            route.check()

    async def _release(self, which: Callable[[str], bool] = lambda step: True) -> None:
        """Release the locks (and route reservations) the saga holds for the steps ``which`` names."""
        for name, route in list(self.routes.items()):
            if which(name):
                del self.routes[name]
                await route.close()
                self._released.update((name, resource) for resource in route.resources)
        for resource, lease in list(self.leases.items()):
            if which(lease.step):
                del self.leases[resource]
                await lease.close()
                self._released.add((lease.step, resource))

    async def _fail(self, step: str, error: BaseException) -> None:
        """Record the failure, compensate the completed steps in reverse, release every lock."""
        self._failed = True
        try:
            await self._release(lambda taken: taken == step)
            try:
                await self._post(f"/steps/{step}/fail", {"reason": _reason(error)})
            except LockLedgerError as refused:
                if not await self._lapsed_into_compensation(refused):
                    raise
            await self.compensate()
        finally:
            await self._release()
            await self._release_leftovers([step])

    async def _lapsed_into_compensation(self, refused: LockLedgerError) -> bool:
        """Whether a refused transition found the saga compensating because the server lapsed its lease
        (this orchestrator was cut off longer than the lease): then it compensates, as it is still here."""
        if refused.code != "saga_conflict":
            return False
        return (await self.refresh()).status == "compensating"

    async def abort(self, reason: str) -> None:
        """Ask the server to abort (a running saga starts compensating), then compensate and release."""
        self._failed = True
        try:
            await self._post("/abort", {"reason": reason[:500]})
            await self.compensate()
        finally:
            await self._release()
            await self._release_leftovers([])

    async def compensate(self) -> SagaView:
        """Compensate every step the server shows completed or compensating, last first. A step still
        running (the saga was aborted mid-step, and no orchestrator will finish it) is first recorded as
        failed: the server compensates nothing while a step runs, and its action may have half-run."""
        assert self.view is not None
        for step_view in self.view.steps:
            if step_view.status == "running":
                await self._post(f"/steps/{step_view.name}/fail", {"reason": "aborted mid-step"})
        for step_view in reversed(self.view.steps):
            if step_view.status in ("completed", "compensating"):
                await self._compensate_step(step_view)
        return await self.refresh()

    async def _compensate_step(self, step_view: StepView) -> None:
        """``compensation/start``, ``compensate(result)`` under the step's locks, ``compensation/complete``;
        on an error ``compensation/fail`` and again with backoff, until the server calls the saga stuck."""
        name = step_view.name
        step = self.definition.step(name)
        compensate = self._compensations.get(name) or step.compensate
        failures = step_view.compensation_failures
        while True:
            view = await self._post(f"/steps/{name}/compensation/start")
            if view.step(name).status == "compensated":
                return
            try:
                async with asyncio.timeout(step.timeout):
                    await self._take(step, step_view.locks, wait=step.timeout)
                    if compensate is not None:
                        await _run(compensate, step_view.result)
            except Exception as error:
                view = await self._post(f"/steps/{name}/compensation/fail", {"reason": _reason(error)})
                failures += 1
                if view.status == "stuck" or failures >= COMPENSATION_ATTEMPTS:
                    raise SagaStuck(self.id, name, _reason(error), view) from error
                pause = min(_BACKOFF_MAX_S, _BACKOFF_INITIAL_S * 2**failures)
                await asyncio.sleep(pause * random.uniform(0.5, 1))
                continue
            await self._post(f"/steps/{name}/compensation/complete")
            await self._release(lambda taken: taken == name and not step.keep)
            return

    async def refresh(self) -> SagaView:
        """The saga as the server has it now, with its timeline."""
        self.view = await get_saga(self.client, self.id)
        return self.view

    async def complete(self) -> SagaView:
        try:
            return await self._post("/complete")
        finally:
            await self._release()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._finish(exc)
        finally:
            await self._stop_beating()

    async def _finish(self, exc: BaseException | None) -> None:
        if self._failed:  # a step failed: compensated and released already
            await self._release()
            return
        if exc is None:
            await self.complete()
            return
        # An exception in the block between steps (or a saga the server lapsed, its step refused): undo
        # what was done, and let it propagate.
        try:
            await self.abort(_reason(exc))
        except Exception:
            log.exception("saga abort after an error failed", extra={"saga_id": self.saga_id})

    # --- recovery --------------------------------------------------------------------------------------

    async def recover(self, view: SagaView) -> SagaView:
        """Finish an unfinished saga from its log alone: forward or compensated, as its policy says."""
        self.view = view
        self.saga_id = view.saga_id
        self._beat_while_running(view)
        try:
            if view.status == "running" and all(s.status == "completed" for s in view.steps):
                return await self.complete()  # nothing left to run or to undo: only the record was lost
            if view.status == "running" and view.policy == "forward":
                return await self._forward()
            if view.status == "running":
                running = [s.name for s in view.steps if s.status == "running"]
                if running:  # its action may have half-run: a failure, not completed work
                    await self._post(f"/steps/{running[0]}/fail", {"reason": "orchestrator lost mid-step"})
                else:
                    await self._post("/abort", {"reason": "recovered: the orchestrator was lost"})
            if self.view.status == "compensating":
                await self.compensate()
            return await self.refresh()
        finally:
            await self._stop_beating()
            await self._release()
            await self._release_leftovers()

    async def _forward(self) -> SagaView:
        """Take back the kept locks, run every step not completed (a half-run one again), complete."""
        assert self.view is not None
        self.results = {s.name: s.result for s in self.view.steps if s.status == "completed"}
        for step_view in self.view.steps:
            step = self.definition.step(step_view.name)
            if step_view.status == "completed":
                if step.keep:
                    await self._take(step, step_view.locks, wait=step.timeout)
                continue
            if step.action is None:
                raise _refused(f"step {step.name!r} of {self.definition.name!r} has no action to resume")
            await self._run_step(step, step_view.locks)
        return await self.complete()

    async def _release_leftovers(self, steps: Iterable[str] | None = None) -> None:
        """Release the leases still held for this saga that no lease object here knows of: those of a lost
        orchestrator, or an acquire granted just as its step timed out. The locks list shows which saga
        and step a live lease belongs to; a caller not allowed to read it (an agent's token) goes through
        the Idempotency-Keys of ``steps`` (default: every step that started) instead."""
        owner = self.owner or (self.view.owner if self.view is not None else None)
        if owner is None:
            return
        try:
            await self._release_listed(owner)
        except Forbidden:
            await self._release_by_keys(steps)

    async def _release_listed(self, owner: str) -> None:
        cursor: str | None = None
        while True:
            query = {"holder": owner, "cursor": cursor, "limit": 1000}
            params = {k: v for k, v in query.items() if v is not None}
            data, _ = await _call(self.client, "GET", "/v1/locks", params=params)
            for item in data["items"]:
                if item.get("saga_id") != self.saga_id:
                    continue
                step, resource = str(item.get("saga_step")), str(item["resource"])
                token = int(item["fencing_token"])
                body = {"owner": owner, "fencing_token": token}
                headers = {"X-Saga-ID": self.id, "X-Saga-Step": step}
                key = _key(self.id, step, "recovered", "release", resource, str(token))
                with contextlib.suppress(NotHolder, LeaseExpired):
                    await _call(self.client, "POST", lock_path(resource, "/release"), json=body, key=key,
                                headers=headers)  # fmt: skip
            cursor = data.get("next_cursor")
            if cursor is None:
                return

    async def _release_by_keys(self, steps: Iterable[str] | None) -> None:
        """Take each lock through the step's key chain without waiting, and release it: a lease of ours
        still live is replayed and renewed; a free lock is taken and given back at once (two events in
        its history); one held by another agent is left alone."""
        view = await self.refresh()
        names = set(steps) if steps is not None else {s.name for s in view.steps if s.status != "pending"}
        for step_view in view.steps:
            if step_view.name not in names:
                continue
            step = self.definition.step(step_view.name)
            if step_view.reservation_id is not None:
                await self._release_route_by_keys(step, step_view)
                continue
            for resource in step_view.locks:
                if resource in self.leases or (step.name, resource) in self._released:
                    continue
                lease = _SagaLease(self.client, self.id, step, resource, self.owner, 0.0)
                try:
                    await lease.__aenter__()
                except LockHeld:
                    continue
                await lease.close()

    async def _release_route_by_keys(self, step: Step, step_view: StepView) -> None:
        """A route step's set through its key chain: replayed and released if it is still ours, taken and
        given back if all its locks are free; left to its TTL if another agent holds one of them."""
        released = all((step.name, resource) in self._released for resource in step_view.locks)
        if step.name in self.routes or released or step_view.reservation_id is None:
            return
        route = _SagaRoute(
            self.client, self.id, step, step_view.locks, step_view.reservation_id, self.owner, 0.0
        )
        try:
            await route.__aenter__()
        except LockHeld:
            return
        await route.close()


async def recover_sagas(
    client: SagaClient,
    definitions: Iterable[SagaDefinition] | Mapping[str, SagaDefinition] | None = None,
    owner: str | None = None,
) -> list[SagaView]:
    """Every unfinished saga of ``owner`` (default: the client's agent), finished as its definition's policy
    says; the definitions are looked up by name (default: the registry). Returns their final views; a saga
    whose definition is unknown is left as it is (and logged)."""
    if definitions is None:
        known = registry()
    elif isinstance(definitions, Mapping):
        known = dict(definitions)
    else:
        known = {d.name: d for d in definitions}
    owner = owner or client.agent_id
    finished: list[SagaView] = []
    for status in ("running", "compensating"):
        for view in await _list_sagas(client, status, owner):
            definition = known.get(view.name)
            if definition is None:
                log.warning("no definition for saga", extra={"saga_id": view.saga_id, "saga_name": view.name})
                continue
            saga = AsyncSaga(client, view.saga_id, definition, owner=view.owner)
            try:
                finished.append(await saga.recover(view))
            except SagaStuck as stuck:  # needs an operator; the other sagas still get recovered
                log.error("saga stuck", extra={"saga_id": view.saga_id, "reason": stuck.reason})
                if stuck.view is not None:
                    finished.append(stuck.view)
    await _release_ended(client, owner)
    return finished


async def _release_ended(client: SagaClient, owner: str | None) -> None:
    """Release ``owner``'s leases still tagged with a saga that has ended: a release lost as the saga
    completed or aborted (the saga itself needs no recovery, so nothing else would free the lock before
    its TTL). With an agent's token, which may not list locks, there is nothing to find this way."""
    if owner is None:
        return
    ended: dict[str, bool] = {}
    cursor: str | None = None
    while True:
        query = {"holder": owner, "cursor": cursor, "limit": 1000}
        try:
            data, _ = await _call(client, "GET", "/v1/locks", params={k: v for k, v in query.items() if v})
        except Forbidden:
            return
        for item in data["items"]:
            saga_id = item.get("saga_id")
            if not saga_id:
                continue
            if saga_id not in ended:
                try:
                    ended[saga_id] = (await get_saga(client, saga_id)).finished
                except NotFound:
                    ended[saga_id] = False
            if not ended[saga_id]:
                continue
            step, resource = str(item.get("saga_step")), str(item["resource"])
            token = int(item["fencing_token"])
            key = _key(saga_id, step, "ended", "release", resource, str(token))
            headers = {"X-Saga-ID": saga_id, "X-Saga-Step": step}
            with contextlib.suppress(NotHolder, LeaseExpired):
                await _call(client, "POST", lock_path(resource, "/release"), key=key, headers=headers,
                            json={"owner": owner, "fencing_token": token})  # fmt: skip
        cursor = data.get("next_cursor")
        if cursor is None:
            return


# --- threads -------------------------------------------------------------------------------------------


class _LoopThread:
    """An event loop in a daemon thread, for the blocking twin: it runs the asyncio saga and its
    heartbeats; the blocking client's requests and the steps' plain functions run in its worker threads
    (enough of them that a waiting acquire never holds up a heartbeat or a renewal)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(ThreadPoolExecutor(_WORKER_THREADS, "lockledger-saga-worker"))
        self.thread = threading.Thread(target=self.loop.run_forever, name="lockledger-saga", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


_WORKER_THREADS = 32


class _InThreads:
    """A blocking client as a ``SagaClient``: each request runs in a worker thread of the saga's event
    loop, through the client's own connection pool, transport, retries and breaker."""

    def __init__(self, client: BlockingSagaClient) -> None:
        self._client = client

    @property
    def agent_id(self) -> str | None:
        return self._client.agent_id

    async def request(self, method: str, path: str, **options: Any) -> Reply:
        """``SagaClient.request``, run in a worker thread."""
        return await asyncio.to_thread(functools.partial(self._client.request, method, path, **options))


class Saga:
    """The blocking twin: ``with client.saga(...) as saga: saga.step("pick")``. The saga, its locks and
    their heartbeats live on an event loop in a background thread; the client's requests and the plain
    functions of the steps run in that loop's worker threads."""

    def __init__(
        self,
        client: BlockingSagaClient,
        saga_id: str | None,
        definition: SagaDefinition | str | None,
        params: Mapping[str, Any] | None = None,
        owner: str | None = None,
        lease: float = DEFAULT_LEASE_S,
    ) -> None:
        self._client = _InThreads(client)
        self._args = (saga_id, definition, params, owner, lease)
        self._loop: _LoopThread | None = None
        self._saga: AsyncSaga | None = None

    @classmethod
    def recover_all(
        cls,
        client: BlockingSagaClient,
        definitions: Iterable[SagaDefinition] | Mapping[str, SagaDefinition] | None = None,
        owner: str | None = None,
    ) -> list[SagaView]:
        """``AsyncSaga.recover_all`` for the blocking client (``Client.recover_sagas``)."""
        return recover_sagas_sync(client, definitions, owner)

    @property
    def inner(self) -> AsyncSaga:
        assert self._saga is not None, "use the saga as a context manager"
        return self._saga

    @property
    def saga_id(self) -> str:
        return self.inner.id

    @property
    def view(self) -> SagaView | None:
        return self.inner.view

    def __enter__(self) -> Self:
        self._loop = _LoopThread()
        saga_id, definition, params, owner, lease = self._args
        self._saga = AsyncSaga(self._client, saga_id, definition, params, owner, lease)
        try:
            self._loop.run(self._saga.__aenter__())
        except BaseException:
            self._close()
            raise
        return self

    def step(
        self,
        name: str,
        *,
        lock: str | None = None,
        locks: Sequence[str] | None = None,
        action: Callable[[StepContext], Result] | None = None,
        compensate: Callable[[Result], None] | None = None,
        timeout: float | None = None,
        keep: bool | None = None,
    ) -> Result:
        """As ``AsyncSaga.step``; a plain function cannot be interrupted: past its timeout the step fails
        when it returns."""
        assert self._loop is not None
        coro = self.inner.step(
            name, lock=lock, locks=locks, action=action, compensate=compensate, timeout=timeout, keep=keep
        )
        return self._loop.run(coro)

    def refresh(self) -> SagaView:
        assert self._loop is not None
        return self._loop.run(self.inner.refresh())

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._loop is not None
        try:
            self._loop.run(self.inner.__aexit__(exc_type, exc, tb))
        finally:
            self._close()

    def _close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None


def recover_sagas_sync(
    client: BlockingSagaClient,
    definitions: Iterable[SagaDefinition] | Mapping[str, SagaDefinition] | None = None,
    owner: str | None = None,
) -> list[SagaView]:
    """``recover_sagas`` for the blocking client."""
    loop = _LoopThread()
    try:
        return loop.run(recover_sagas(_InThreads(client), definitions, owner))
    finally:
        loop.close()
