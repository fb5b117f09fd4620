"""HTTP clients for lockledger: ``AsyncClient`` (asyncio) and ``Client`` (threads), same methods.

Why the shape: every command carries an Idempotency-Key chosen *before* the first attempt, so a retry
after a lost response replays the stored answer instead of taking a second lock or releasing twice.
Retries (stamina: jittered exponential backoff, bounded by attempts and total time) cover only what a
retry can fix: transport errors, timeouts and 5xx. A 4xx is the server's considered answer and is raised
at once as a typed exception. Every attempt passes through a circuit breaker first, so while the service
is down calls fail in microseconds with ``CircuitOpen`` and no network I/O. A transport error (connection
refused, reset, timed out) that outlasts the retries is raised as ``Unavailable``, like a 503, with the
httpx error as its cause: callers catch the SDK's exceptions, never httpx's.

Durations are seconds as floats everywhere in this API (``ttl``, ``wait``, ``timeout``, ``retry_timeout``,
``expiring_within``, ``LeaseInfo.ttl``), as in httpx and asyncio; the server's ``*_ms`` fields are
converted to and from at the HTTP boundary only. A resource (or an owner) is checked before it goes into
a URL. Instants (the replay API's ``at``, ``from_``, ``to``) are aware datetimes or RFC 3339 strings with
an offset, never naive ones (``lockledger.replay``).

The export (``export``) is streamed: one event at a time, whatever the range, and a connection cut
mid-stream is resumed after the last event yielded, a bounded number of times in a row.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import httpx
import stamina

from lockledger.errors import (
    LockLedgerError,
    LockLost,
    Unavailable,
    ValidationError,
    error_from_response,
    parse_datetime,
)
from lockledger.feed import FeedEvent, FeedOverflow, parse_sse
from lockledger.lease import AsyncLease, Lease
from lockledger.replay import (
    AgentEvent,
    AgentHistory,
    Change,
    Changes,
    ExportedEvent,
    ReplayLease,
    ReplayState,
    filters,
    instant,
    time_range,
)
from lockledger_breaker import CircuitBreaker

if TYPE_CHECKING:
    from lockledger.saga import AsyncSaga, Saga, SagaDefinition, SagaView

__all__ = [
    "AgentEvent",
    "AgentHistory",
    "AsyncClient",
    "Change",
    "Changes",
    "Client",
    "ExportedEvent",
    "ForceReleased",
    "History",
    "HistoryEvent",
    "LeaseInfo",
    "LockInfo",
    "LockPage",
    "Released",
    "ReplayLease",
    "ReplayState",
]


# --- typed results -------------------------------------------------------------------------------------


def _seconds(ms: Any) -> float:
    return int(ms) / 1000


def _dt(value: Any) -> datetime:
    parsed = parse_datetime(value)
    if parsed is None:
        raise ValueError("missing datetime")
    return parsed


@dataclass(frozen=True)
class LeaseInfo:
    """A granted or renewed lease of ``ttl`` seconds. ``expires_at`` is by the database clock."""

    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    ttl: float

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeaseInfo:
        return cls(
            d["resource"], d["owner"], int(d["fencing_token"]), _dt(d["expires_at"]), _seconds(d["ttl_ms"])
        )


@dataclass(frozen=True)
class Released:
    resource: str
    owner: str
    fencing_token: int
    released: bool

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Released:
        return cls(d["resource"], d["owner"], int(d["fencing_token"]), bool(d["released"]))


@dataclass(frozen=True)
class ForceReleased:
    resource: str
    released: bool
    owner: str | None
    fencing_token: int | None
    event: str | None
    reason: str | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ForceReleased:
        return cls(
            d["resource"], bool(d["released"]), d.get("owner"), d.get("fencing_token"), d.get("event"),
            d.get("reason"),
        )  # fmt: skip


@dataclass(frozen=True)
class LockInfo:
    """A lock's projected state: ``status`` is ``held``, ``free`` or ``expired`` (lapsed, not yet reaped);
    ``ttl`` is the last grant's lease length in seconds."""

    resource: str
    status: str
    owner: str | None
    fencing_token: int
    ttl: float | None
    expires_at: datetime | None
    acquired_at: datetime | None
    updated_at: datetime
    version: int
    ended_by: str | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LockInfo:
        return cls(
            d["resource"], d["status"], d.get("owner"), int(d["fencing_token"]),
            None if d.get("ttl_ms") is None else _seconds(d["ttl_ms"]),
            parse_datetime(d.get("expires_at")), parse_datetime(d.get("acquired_at")), _dt(d["updated_at"]),
            int(d["version"]), d.get("ended_by"),
        )  # fmt: skip


@dataclass(frozen=True)
class LockPage:
    items: list[LockInfo]
    next_cursor: str | None


@dataclass(frozen=True)
class HistoryEvent:
    position: int
    version: int
    event_id: str
    type: str
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: datetime

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HistoryEvent:
        return cls(
            int(d["position"]), int(d["version"]), str(d["event_id"]), d["type"], d["data"], d["metadata"],
            _dt(d["recorded_at"]),
        )  # fmt: skip


@dataclass(frozen=True)
class History:
    resource: str
    events: list[HistoryEvent]
    next_after_version: int | None


# --- shared request plumbing ---------------------------------------------------------------------------


def _retry_hook(exc: Exception) -> bool | float:
    """stamina's ``on``: retry transport errors and 5xx; a Retry-After hint becomes the wait."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, Unavailable) and exc.retry_after is not None:
        return max(exc.retry_after, 0.05)
    return isinstance(exc, LockLedgerError) and exc.status >= 500


def _locks_query(
    holder: str | None,
    prefix: str | None,
    expiring_within: float | None,
    cursor: str | None,
    limit: int | None,
) -> dict[str, Any]:
    params = {"holder": holder, "prefix": prefix, "cursor": cursor, "limit": limit}
    params["expiring_within_ms"] = (
        None if expiring_within is None else _ms("expiring_within", expiring_within)
    )
    return {k: v for k, v in params.items() if v is not None}


def _owner(owner: str | None) -> dict[str, Any]:
    """Without an owner the server uses the token's principal (a dev-mode server answers 422)."""
    return {"owner": owner} if owner is not None else {}


def _refused(detail: str) -> ValidationError:
    """The SDK's own ``validation_error``, for an argument it will not send (status 0: nothing was sent)."""
    return ValidationError(0, {"code": "validation_error", "detail": detail})


# The server's rule for a resource id (one URL path segment): 1-200 of these characters, not only dots
# ("." and ".." are dot-segments every HTTP client rewrites). The SDK keeps its own copy of the rule, as
# it imports no server code.
_RESOURCE_RE = re.compile(r"[A-Za-z0-9._:\-]{1,200}")
_RESOURCE_RULE = "1-200 characters of A-Z, a-z, 0-9 and . _ : - (not only dots)"


def check_resource(resource: str) -> str:
    """``resource`` if the server could accept it; else ``ValidationError`` (also a ``ValueError``) before
    anything is sent, so no URL is ever built from a resource like ``a/b``, ``..`` or ``""``."""
    if not isinstance(resource, str) or not _RESOURCE_RE.fullmatch(resource) or not resource.strip("."):
        raise _refused(f"invalid resource {resource!r:.80}: {_RESOURCE_RULE}")
    return resource


def _path(resource: str, action: str = "") -> str:
    return f"/v1/locks/{check_resource(resource)}{action}"


# The server's rule for an owner (a lease holder, an agent's principal); it names a URL path segment in
# ``agent_history``.
_OWNER_RE = re.compile(r"[A-Za-z0-9._:@\-]{1,200}")


def check_owner(owner: str) -> str:
    """``owner`` if the server could accept it; else ``ValidationError`` before anything is sent."""
    if not isinstance(owner, str) or not _OWNER_RE.fullmatch(owner) or not owner.strip("."):
        raise _refused(f"invalid owner {owner!r:.80}: 1-200 characters of A-Z, a-z, 0-9 and . _ : @ -")
    return owner


# Replay answers are read whole (every page): the largest page the server gives keeps round trips few.
_PAGE = 1000
_STATE_PAGE = 10_000  # the state at an instant comes in pages this large: a whole fleet in one
# An export filtered by type, owner or prefix may scan a long stretch of the log between two matches: the
# wait for the next line may be far longer than for an ordinary answer.
_EXPORT_READ_TIMEOUT = 60.0


def _streaming_timeout(base: httpx.Timeout) -> httpx.Timeout:
    read = None if base.read is None else max(base.read, _EXPORT_READ_TIMEOUT)
    return httpx.Timeout(connect=base.connect, read=read, write=base.write, pool=base.pool)


def _state_query(at: datetime | str, prefix: str | None, owner: str | None) -> dict[str, Any]:
    return {"at": instant("at", at), **filters(prefix=prefix, owner=owner), "limit": _STATE_PAGE}


def _changes_query(
    from_: datetime | str, to: datetime | str, prefix: str | None, owner: str | None
) -> dict[str, Any]:
    return {"from": instant("from_", from_), "to": instant("to", to), **filters(prefix=prefix, owner=owner),
            "limit": _PAGE}  # fmt: skip


def _history(data: dict[str, Any]) -> History:
    events = [HistoryEvent.from_json(e) for e in data["events"]]
    return History(data["resource"], events, data["next_after_version"])


def _agent_history(data: dict[str, Any]) -> AgentHistory:
    events = [AgentEvent.from_json(e) for e in data["events"]]
    return AgentHistory(data["owner"], events, data["next_after_position"])


def _export_query(
    from_: datetime | str | None,
    to: datetime | str | None,
    type: str | None,
    owner: str | None,
    prefix: str | None,
) -> dict[str, Any]:
    return {**time_range(from_, to), **filters(type=type, owner=owner, prefix=prefix)}


def _cut_off(exc: Exception, position: int, attempts: int) -> Unavailable:
    """The error for an export whose connections kept being cut before any new event (status 0)."""
    detail = (
        f"GET /v1/events: {attempts} connections in a row cut before a new event, after position"
        f" {position} ({type(exc).__name__}: {exc}); resume with after_position={position}"
    )
    return Unavailable(0, {"code": "unavailable", "detail": detail})


def _ms(name: str, seconds: float) -> int:
    """A duration in seconds as the server's whole milliseconds (its ``*_ms`` fields): the one place the
    SDK's unit meets the wire's."""
    if not math.isfinite(seconds) or seconds < 0:
        raise _refused(f"{name} must be a finite number of seconds >= 0, not {seconds!r}")
    return round(seconds * 1000)


def _ttl(ttl: float | None) -> dict[str, Any]:
    """Without a ttl the server uses its default (acquire) or the lease's current one (renew)."""
    return {} if ttl is None else {"ttl_ms": _ms("ttl", ttl)}


def _wait(wait: float) -> dict[str, Any]:
    wait_ms = _ms("wait", wait)
    return {"wait_ms": wait_ms} if wait_ms else {}


def _waiting_timeout(base: httpx.Timeout, wait: float) -> httpx.Timeout:
    """The client's timeout with the server's wait added to the read, so a waiting acquire is not cut off
    (the client's own when nothing waits)."""
    if not wait:
        return base
    read = None if base.read is None else base.read + wait
    return httpx.Timeout(connect=base.connect, read=read, write=base.write, pool=base.pool)


class _Base:
    """Configuration, breaker bookkeeping and response classification shared by both clients."""

    def __init__(
        self,
        *,
        retry_attempts: int,
        retry_timeout: float,
        breaker: CircuitBreaker | None,
        agent_id: str | None,
        token: str | None,
    ) -> None:
        self.retry_attempts = retry_attempts
        self.retry_timeout = retry_timeout
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        # With a token the server knows who we are: leases are the token's, and naming anyone else is a 403.
        self.agent_id = agent_id or (None if token else f"agent-{uuid.uuid4().hex[:12]}")

    @staticmethod
    def _auth(headers: dict[str, str] | None, token: str | None) -> dict[str, str]:
        return {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}

    def _retries(self, wait: float = 0.0) -> Any:
        """stamina's retries; a waiting acquire's own wait does not use up the time left for them."""
        return stamina.retry_context(
            on=_retry_hook,
            attempts=self.retry_attempts,
            timeout=self.retry_timeout + wait,
            wait_initial=0.05,
            wait_max=2.0,
        )

    @staticmethod
    def _headers(key: str | None) -> dict[str, str] | None:
        return {"Idempotency-Key": key} if key else None

    def _settle(self, response: httpx.Response, started: float, wait: float = 0.0) -> httpx.Response:
        """Record the attempt in the breaker (a 4xx means a healthy server) and raise typed errors. The time
        a waiting acquire was allowed to wait for the lock is not the server being slow."""
        elapsed = max(0.0, time.monotonic() - started - wait)
        if response.status_code >= 500:
            self.breaker.on_error(elapsed)
        else:
            self.breaker.on_success(elapsed)
        if response.is_error:
            raise error_from_response(response)
        return response

    @staticmethod
    def _unreachable(exc: httpx.TransportError, method: str, path: str) -> Unavailable:
        """The SDK's error for a request that never got an answer (raised ``from`` ``exc``); status 0,
        as no HTTP status was received."""
        try:
            url = str(exc.request.url)
        except RuntimeError:  # an error raised without its request
            url = path
        detail = f"{method} {url}: no answer after retries ({type(exc).__name__}: {exc})"
        return Unavailable(0, {"code": "unavailable", "detail": detail})

    def _failed(self, exc: BaseException, started: float, wait: float = 0.0) -> None:
        if isinstance(exc, httpx.TransportError):
            self.breaker.on_error(max(0.0, time.monotonic() - started - wait))
        else:  # cancelled, or a bug of ours: says nothing about the server's health
            self.breaker.release_permission()


# --- asyncio -------------------------------------------------------------------------------------------


class AsyncClient(_Base):
    """The asyncio client. Use ``async with AsyncClient(url) as c:``; ``c.lock(...)`` for managed leases."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        retry_attempts: int = 5,
        retry_timeout: float = 10.0,
        breaker: CircuitBreaker | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
        agent_id: str | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(
            retry_attempts=retry_attempts,
            retry_timeout=retry_timeout,
            breaker=breaker,
            agent_id=agent_id,
            token=token,
        )
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=transport, headers=self._auth(headers, token)
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        wait: float = 0.0,
    ) -> Any:
        key = str(uuid.uuid4()) if method == "POST" else None  # one key for every attempt of this command
        timeout = _waiting_timeout(self._http.timeout, wait)
        try:
            async for attempt in self._retries(wait):
                with attempt:
                    self.breaker.acquire_permission()  # CircuitOpen here: nothing was sent
                    started = time.monotonic()
                    try:
                        response = await self._http.request(
                            method,
                            path,
                            json=json,
                            params=params,
                            headers=self._headers(key),
                            timeout=timeout,
                        )
                    except BaseException as exc:
                        self._failed(exc, started, wait)
                        raise
                    return self._settle(response, started, wait).json()
        except httpx.TransportError as exc:
            raise self._unreachable(exc, method, path) from exc
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def acquire(
        self, resource: str, owner: str | None = None, ttl: float | None = None, wait: float = 0.0
    ) -> LeaseInfo:
        """Take the lock for ``ttl`` seconds (the server's default, 30 s, if None); if it is held, the
        server waits up to ``wait`` seconds (at most its ``LOCKLEDGER_MAX_WAIT_MS``) for it to come free
        before raising ``LockHeld``."""
        path = _path(resource, "/acquire")
        body = {**_owner(owner), **_ttl(ttl), **_wait(wait)}
        return LeaseInfo.from_json(await self._request("POST", path, json=body, wait=wait))

    async def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl: float | None = None
    ) -> LeaseInfo:
        """Extend the lease to ``ttl`` seconds from now (the lease's current length if None)."""
        path = _path(resource, "/renew")
        body = {**_owner(owner), "fencing_token": fencing_token, **_ttl(ttl)}
        return LeaseInfo.from_json(await self._request("POST", path, json=body))

    async def release(self, resource: str, owner: str | None, fencing_token: int) -> Released:
        path = _path(resource, "/release")
        body = {**_owner(owner), "fencing_token": fencing_token}
        return Released.from_json(await self._request("POST", path, json=body))

    async def force_release(self, resource: str, reason: str) -> ForceReleased:
        path = _path(resource, "/force-release")
        return ForceReleased.from_json(await self._request("POST", path, json={"reason": reason}))

    async def get_lock(self, resource: str) -> LockInfo:
        """The lock's state; ``NotFound`` if it was never locked."""
        return LockInfo.from_json(await self._request("GET", _path(resource)))

    async def list_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within: float | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> LockPage:
        """One page of live leases; ``expiring_within`` (seconds): only those whose deadline is that near."""
        params = _locks_query(holder, prefix, expiring_within, cursor, limit)
        data = await self._request("GET", "/v1/locks", params=params)
        return LockPage([LockInfo.from_json(i) for i in data["items"]], data["next_cursor"])

    async def iter_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within: float | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[LockInfo]:
        """Every live lease matching the filters, following ``next_cursor`` page by page."""
        cursor: str | None = None
        while True:
            page = await self.list_locks(
                holder=holder,
                prefix=prefix,
                expiring_within=expiring_within,
                cursor=cursor,
                limit=limit,
            )
            for item in page.items:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def history(
        self,
        resource: str,
        after_version: int = 0,
        limit: int = 100,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
    ) -> History:
        """One page of the resource's events in version order, after ``after_version``; with ``from_`` or
        ``to``, only those recorded in ``[from_, to)``. ``next_after_version`` continues it (None: done)."""
        params = {"after_version": after_version, "limit": limit, **time_range(from_, to)}
        return _history(await self._request("GET", _path(resource, "/history"), params=params))

    async def agent_history(
        self,
        owner: str,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
        after_position: int = 0,
        limit: int = 100,
    ) -> AgentHistory:
        """One page of an agent's events across every resource, in log order, after ``after_position``,
        recorded in ``[from_, to)``. ``next_after_position`` continues it (None: done)."""
        params = {"after_position": after_position, "limit": limit, **time_range(from_, to)}
        path = f"/v1/agents/{check_owner(owner)}/history"
        return _agent_history(await self._request("GET", path, params=params))

    async def replay_state(
        self, at: datetime | str, *, prefix: str | None = None, owner: str | None = None
    ) -> ReplayState:
        """Every lease live at the past instant ``at`` (all pages), by resource. ``ValidationError`` for a
        future instant."""
        query = _state_query(at, prefix, owner)
        first: dict[str, Any] | None = None
        locks: list[ReplayLease] = []
        cursor: str | None = None
        while True:
            params = {**query, **filters(cursor=cursor)}
            data = await self._request("GET", "/v1/replay/state", params=params)
            first = first or data
            locks += [ReplayLease.from_json(item) for item in data["locks"]]
            cursor = data["next_cursor"]
            if cursor is None:
                return ReplayState(_dt(first["at"]), int(first["position"]), locks)

    async def changes(
        self,
        from_: datetime | str,
        to: datetime | str,
        *,
        prefix: str | None = None,
        owner: str | None = None,
    ) -> Changes:
        """Everything that changed after ``from_`` up to ``to`` (all pages), in time order."""
        query = _changes_query(from_, to, prefix, owner)
        first: dict[str, Any] | None = None
        found: list[Change] = []
        cursor: str | None = None
        while True:
            params = {**query, **filters(cursor=cursor)}
            data = await self._request("GET", "/v1/replay/changes", params=params)
            first = first or data
            found += [Change.from_json(item) for item in data["changes"]]
            cursor = data["next_cursor"]
            if cursor is None:
                return Changes(_dt(first["from"]), _dt(first["to"]), found)

    async def export(
        self,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
        after_position: int = 0,
        type: str | None = None,
        owner: str | None = None,
        prefix: str | None = None,
    ) -> AsyncIterator[ExportedEvent]:
        """Every matching event after ``after_position`` recorded in ``[from_, to)``, in position order,
        streamed (memory stays flat). A cut connection is resumed after the last event yielded; once
        ``retry_attempts`` connections in a row are cut before yielding any event, ``Unavailable``."""
        query = _export_query(from_, to, type, owner, prefix)
        position, cuts = after_position, 0
        while True:
            response = await self._open_stream("/v1/events", {**query, "after_position": position})
            resumed_at = position
            try:
                async for line in response.aiter_lines():
                    if line.strip():
                        event = ExportedEvent.from_line(line)
                        position = event.position
                        yield event
                return
            except (httpx.TransportError, ValueError) as exc:  # ValueError: a line cut in two
                cuts = 0 if position != resumed_at else cuts + 1
                if cuts >= self.retry_attempts:
                    raise _cut_off(exc, position, cuts) from exc
            finally:
                await response.aclose()

    async def watch(
        self,
        after_position: int | None = None,
        *,
        prefix: str | None = None,
        owner: str | None = None,
        type: str | None = None,
        saga: str | None = None,
        last_event_id: str | None = None,
    ) -> AsyncIterator[FeedEvent]:
        """The change feed (``GET /v1/events/stream``): every matching event once, as it is committed,
        from ``after_position`` (or ``last_event_id``, a ``FeedEvent.id``) or from now; never ends by
        itself. A cut connection, or the server's ``overflow`` for a client too slow, is resumed with
        ``Last-Event-ID`` = the last id received; once ``retry_attempts`` connections in a row end before a
        new event, ``Unavailable``."""
        filters_ = {"prefix": prefix, "owner": owner, "type": type, "saga": saga}
        query: dict[str, Any] = {name: value for name, value in filters_.items() if value}
        if after_position is not None:
            query["after_position"] = after_position
        place, cuts = last_event_id, 0
        timeout = _streaming_timeout(self._http.timeout)
        while True:
            headers = {"Last-Event-ID": place} if place is not None else {}
            try:
                async for attempt in self._retries():
                    with attempt:
                        self.breaker.acquire_permission()
                        started = time.monotonic()
                        try:
                            request = self._http.build_request(
                                "GET", "/v1/events/stream", params=query, headers=headers, timeout=timeout
                            )
                            response = await self._http.send(request, stream=True)
                            if response.is_error:
                                try:
                                    await response.aread()
                                finally:
                                    await response.aclose()
                        except BaseException as exc:
                            self._failed(exc, started)
                            raise
                        response = self._settle(response, started)
                        break
            except httpx.TransportError as exc:
                raise self._unreachable(exc, "GET", "/v1/events/stream") from exc
            resumed_at = place
            try:
                async for message in parse_sse(response.aiter_lines()):
                    if message.event == "overflow":
                        place = FeedOverflow.from_message(message).last_event_id or place
                        break
                    event = FeedEvent.from_message(message)
                    place = event.id
                    yield event
                cuts = 0 if place != resumed_at else cuts + 1
            except (httpx.TransportError, ValueError):  # ValueError: a message cut in two
                cuts = 0 if place != resumed_at else cuts + 1
            finally:
                await response.aclose()
            if cuts >= self.retry_attempts:
                detail = f"GET /v1/events/stream: {cuts} connections in a row ended before a new event"
                raise Unavailable(0, {"code": "unavailable", "detail": f"{detail}; resume from {place}"})

    async def _open_stream(self, path: str, params: dict[str, Any]) -> httpx.Response:
        """A GET whose body is left to read: retried and guarded by the breaker like ``_request`` up to the
        response head. The caller closes it."""
        timeout = _streaming_timeout(self._http.timeout)
        try:
            async for attempt in self._retries():
                with attempt:
                    self.breaker.acquire_permission()
                    started = time.monotonic()
                    try:
                        request = self._http.build_request("GET", path, params=params, timeout=timeout)
                        response = await self._http.send(request, stream=True)
                        if response.is_error:  # the problem body, read whole, for the typed error
                            try:
                                await response.aread()
                            finally:
                                await response.aclose()
                    except BaseException as exc:
                        self._failed(exc, started)
                        raise
                    return self._settle(response, started)
        except httpx.TransportError as exc:
            raise self._unreachable(exc, "GET", path) from exc
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._request("GET", "/healthz")
        return result

    async def ready(self) -> dict[str, Any]:
        """``{"status": "ready"}``, or ``Unavailable`` (after retries) while the database is down."""
        result: dict[str, Any] = await self._request("GET", "/readyz")
        return result

    def lock(
        self,
        resource: str,
        *,
        owner: str | None = None,
        ttl: float = 30.0,
        wait: float = 0.0,
        on_lost: Callable[[LockLost], None] | None = None,
        safety_margin: float = 0.1,
    ) -> AsyncLease:
        """A managed lease: ``async with client.lock("zone:A3", ttl=30, wait=5) as lease:`` (seconds).

        See ``lockledger.lease`` for the renewal and loss rules; ``safety_margin`` is a fraction of ``ttl``.
        """
        resource = check_resource(resource)
        return AsyncLease(self, resource, owner or self.agent_id, ttl, wait, on_lost, safety_margin)

    def saga(
        self,
        saga_id: str | None,
        definition: SagaDefinition | str | None = None,
        *,
        name: str | None = None,
        params: Mapping[str, Any] | None = None,
        owner: str | None = None,
    ) -> AsyncSaga:
        """A saga of ``definition`` (or of the registered definition ``name``), its lock templates filled
        from ``params``: ``async with client.saga("move-42", name="pallet-to-zone", params=...) as saga:``.
        See ``lockledger.saga``."""
        from lockledger.saga import AsyncSaga

        return AsyncSaga(self, saga_id, definition or name, params, owner)

    async def recover_sagas(
        self,
        definitions: Iterable[SagaDefinition] | Mapping[str, SagaDefinition] | None = None,
        *,
        owner: str | None = None,
    ) -> list[SagaView]:
        """Finish this agent's unfinished sagas from the server's log alone (forward or compensated, as
        each definition's ``policy`` says; definitions by name, default the registry)."""
        from lockledger.saga import recover_sagas

        return await recover_sagas(self, definitions, owner)


# --- threads -------------------------------------------------------------------------------------------


class Client(_Base):
    """The blocking twin of ``AsyncClient``; ``with client.lock(...)`` renews from a background thread."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        retry_attempts: int = 5,
        retry_timeout: float = 10.0,
        breaker: CircuitBreaker | None = None,
        transport: httpx.BaseTransport | None = None,
        headers: dict[str, str] | None = None,
        agent_id: str | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(
            retry_attempts=retry_attempts,
            retry_timeout=retry_timeout,
            breaker=breaker,
            agent_id=agent_id,
            token=token,
        )
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, transport=transport, headers=self._auth(headers, token)
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        wait: float = 0.0,
    ) -> Any:
        key = str(uuid.uuid4()) if method == "POST" else None
        timeout = _waiting_timeout(self._http.timeout, wait)
        try:
            for attempt in self._retries(wait):
                with attempt:
                    self.breaker.acquire_permission()
                    started = time.monotonic()
                    try:
                        response = self._http.request(
                            method,
                            path,
                            json=json,
                            params=params,
                            headers=self._headers(key),
                            timeout=timeout,
                        )
                    except BaseException as exc:
                        self._failed(exc, started, wait)
                        raise
                    return self._settle(response, started, wait).json()
        except httpx.TransportError as exc:
            raise self._unreachable(exc, method, path) from exc
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    def acquire(
        self, resource: str, owner: str | None = None, ttl: float | None = None, wait: float = 0.0
    ) -> LeaseInfo:
        """Take the lock for ``ttl`` seconds (the server's default, 30 s, if None); if it is held, the
        server waits up to ``wait`` seconds (at most its ``LOCKLEDGER_MAX_WAIT_MS``) for it to come free
        before raising ``LockHeld``."""
        path = _path(resource, "/acquire")
        body = {**_owner(owner), **_ttl(ttl), **_wait(wait)}
        return LeaseInfo.from_json(self._request("POST", path, json=body, wait=wait))

    def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl: float | None = None
    ) -> LeaseInfo:
        """Extend the lease to ``ttl`` seconds from now (the lease's current length if None)."""
        path = _path(resource, "/renew")
        body = {**_owner(owner), "fencing_token": fencing_token, **_ttl(ttl)}
        return LeaseInfo.from_json(self._request("POST", path, json=body))

    def release(self, resource: str, owner: str | None, fencing_token: int) -> Released:
        path = _path(resource, "/release")
        body = {**_owner(owner), "fencing_token": fencing_token}
        return Released.from_json(self._request("POST", path, json=body))

    def force_release(self, resource: str, reason: str) -> ForceReleased:
        path = _path(resource, "/force-release")
        return ForceReleased.from_json(self._request("POST", path, json={"reason": reason}))

    def get_lock(self, resource: str) -> LockInfo:
        """The lock's state; ``NotFound`` if it was never locked."""
        return LockInfo.from_json(self._request("GET", _path(resource)))

    def list_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within: float | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> LockPage:
        """One page of live leases; ``expiring_within`` (seconds): only those whose deadline is that near."""
        params = _locks_query(holder, prefix, expiring_within, cursor, limit)
        data = self._request("GET", "/v1/locks", params=params)
        return LockPage([LockInfo.from_json(i) for i in data["items"]], data["next_cursor"])

    def iter_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within: float | None = None,
        limit: int | None = None,
    ) -> Iterator[LockInfo]:
        cursor: str | None = None
        while True:
            page = self.list_locks(
                holder=holder,
                prefix=prefix,
                expiring_within=expiring_within,
                cursor=cursor,
                limit=limit,
            )
            yield from page.items
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def history(
        self,
        resource: str,
        after_version: int = 0,
        limit: int = 100,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
    ) -> History:
        """One page of the resource's events in version order, after ``after_version``; with ``from_`` or
        ``to``, only those recorded in ``[from_, to)``. ``next_after_version`` continues it (None: done)."""
        params = {"after_version": after_version, "limit": limit, **time_range(from_, to)}
        return _history(self._request("GET", _path(resource, "/history"), params=params))

    def agent_history(
        self,
        owner: str,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
        after_position: int = 0,
        limit: int = 100,
    ) -> AgentHistory:
        """One page of an agent's events across every resource, in log order, after ``after_position``,
        recorded in ``[from_, to)``. ``next_after_position`` continues it (None: done)."""
        params = {"after_position": after_position, "limit": limit, **time_range(from_, to)}
        path = f"/v1/agents/{check_owner(owner)}/history"
        return _agent_history(self._request("GET", path, params=params))

    def replay_state(
        self, at: datetime | str, *, prefix: str | None = None, owner: str | None = None
    ) -> ReplayState:
        """Every lease live at the past instant ``at`` (all pages), by resource. ``ValidationError`` for a
        future instant."""
        query = _state_query(at, prefix, owner)
        first: dict[str, Any] | None = None
        locks: list[ReplayLease] = []
        cursor: str | None = None
        while True:
            params = {**query, **filters(cursor=cursor)}
            data = self._request("GET", "/v1/replay/state", params=params)
            first = first or data
            locks += [ReplayLease.from_json(item) for item in data["locks"]]
            cursor = data["next_cursor"]
            if cursor is None:
                return ReplayState(_dt(first["at"]), int(first["position"]), locks)

    def changes(
        self,
        from_: datetime | str,
        to: datetime | str,
        *,
        prefix: str | None = None,
        owner: str | None = None,
    ) -> Changes:
        """Everything that changed after ``from_`` up to ``to`` (all pages), in time order."""
        query = _changes_query(from_, to, prefix, owner)
        first: dict[str, Any] | None = None
        found: list[Change] = []
        cursor: str | None = None
        while True:
            params = {**query, **filters(cursor=cursor)}
            data = self._request("GET", "/v1/replay/changes", params=params)
            first = first or data
            found += [Change.from_json(item) for item in data["changes"]]
            cursor = data["next_cursor"]
            if cursor is None:
                return Changes(_dt(first["from"]), _dt(first["to"]), found)

    def export(
        self,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
        after_position: int = 0,
        type: str | None = None,
        owner: str | None = None,
        prefix: str | None = None,
    ) -> Iterator[ExportedEvent]:
        """Every matching event after ``after_position`` recorded in ``[from_, to)``, in position order,
        streamed; cut connections are resumed as in ``AsyncClient.export``. Exhaust or close the iterator:
        it holds a connection until then."""
        query = _export_query(from_, to, type, owner, prefix)
        position, cuts = after_position, 0
        while True:
            response = self._open_stream("/v1/events", {**query, "after_position": position})
            resumed_at = position
            try:
                for line in response.iter_lines():
                    if line.strip():
                        event = ExportedEvent.from_line(line)
                        position = event.position
                        yield event
                return
            except (httpx.TransportError, ValueError) as exc:  # ValueError: a line cut in two
                cuts = 0 if position != resumed_at else cuts + 1
                if cuts >= self.retry_attempts:
                    raise _cut_off(exc, position, cuts) from exc
            finally:
                response.close()

    def _open_stream(self, path: str, params: dict[str, Any]) -> httpx.Response:
        timeout = _streaming_timeout(self._http.timeout)
        try:
            for attempt in self._retries():
                with attempt:
                    self.breaker.acquire_permission()
                    started = time.monotonic()
                    try:
                        request = self._http.build_request("GET", path, params=params, timeout=timeout)
                        response = self._http.send(request, stream=True)
                        if response.is_error:
                            try:
                                response.read()
                            finally:
                                response.close()
                    except BaseException as exc:
                        self._failed(exc, started)
                        raise
                    return self._settle(response, started)
        except httpx.TransportError as exc:
            raise self._unreachable(exc, "GET", path) from exc
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/healthz")
        return result

    def ready(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/readyz")
        return result

    def lock(
        self,
        resource: str,
        *,
        owner: str | None = None,
        ttl: float = 30.0,
        wait: float = 0.0,
        on_lost: Callable[[LockLost], None] | None = None,
        safety_margin: float = 0.1,
    ) -> Lease:
        """A managed lease: ``with client.lock("zone:A3", ttl=30, wait=5) as lease:`` (seconds)."""
        resource = check_resource(resource)
        return Lease(self, resource, owner or self.agent_id, ttl, wait, on_lost, safety_margin)

    def saga(
        self,
        saga_id: str | None,
        definition: SagaDefinition | str | None = None,
        *,
        name: str | None = None,
        params: Mapping[str, Any] | None = None,
        owner: str | None = None,
    ) -> Saga:
        """The blocking twin of ``AsyncClient.saga``: ``with client.saga(...) as saga: saga.step("pick")``."""
        from lockledger.saga import Saga

        return Saga(self, saga_id, definition or name, params, owner)

    def recover_sagas(
        self,
        definitions: Iterable[SagaDefinition] | Mapping[str, SagaDefinition] | None = None,
        *,
        owner: str | None = None,
    ) -> list[SagaView]:
        """The blocking twin of ``AsyncClient.recover_sagas``."""
        from lockledger.saga import recover_sagas_sync

        return recover_sagas_sync(self, definitions, owner)
