"""HTTP clients for lockledger: ``AsyncClient`` (asyncio) and ``Client`` (threads), same methods.

Why the shape: every command carries an Idempotency-Key chosen *before* the first attempt, so a retry
after a lost response replays the stored answer instead of taking a second lock or releasing twice.
Retries (stamina: jittered exponential backoff, bounded by attempts and total time) cover only what a
retry can fix: transport errors, timeouts and 5xx. A 4xx is the server's considered answer and is raised
at once as a typed exception. Every attempt passes through a circuit breaker first, so while the service
is down calls fail in microseconds with ``CircuitOpen`` and no network I/O. A transport error (connection
refused, reset, timed out) that outlasts the retries is raised as ``Unavailable``, like a 503, with the
httpx error as its cause: callers catch the SDK's exceptions, never httpx's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Self

import httpx
import stamina

from lockledger.breaker import CircuitBreaker
from lockledger.errors import (
    LockLedgerError,
    LockLost,
    Unavailable,
    error_from_response,
    parse_datetime,
)
from lockledger.lease import AsyncLease, Lease

__all__ = [
    "AsyncClient",
    "Client",
    "ForceReleased",
    "History",
    "HistoryEvent",
    "LeaseInfo",
    "LockInfo",
    "LockPage",
    "Released",
]


# --- typed results -------------------------------------------------------------------------------------


def _dt(value: Any) -> datetime:
    parsed = parse_datetime(value)
    if parsed is None:
        raise ValueError("missing datetime")
    return parsed


@dataclass(frozen=True)
class LeaseInfo:
    """A granted or renewed lease. ``expires_at`` is by the database clock."""

    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    ttl_ms: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeaseInfo:
        return cls(d["resource"], d["owner"], int(d["fencing_token"]), _dt(d["expires_at"]), int(d["ttl_ms"]))


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
    """A lock's projected state: ``status`` is ``held``, ``free`` or ``expired`` (lapsed, not yet reaped)."""

    resource: str
    status: str
    owner: str | None
    fencing_token: int
    ttl_ms: int | None
    expires_at: datetime | None
    acquired_at: datetime | None
    updated_at: datetime
    version: int
    ended_by: str | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LockInfo:
        return cls(
            d["resource"], d["status"], d.get("owner"), int(d["fencing_token"]), d.get("ttl_ms"),
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
    if isinstance(exc, Unavailable) and exc.retry_after_s is not None:
        return max(exc.retry_after_s, 0.05)
    return isinstance(exc, LockLedgerError) and exc.status >= 500


def _clean(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


def _owner(owner: str | None) -> dict[str, Any]:
    """Without an owner the server uses the token's principal (a dev-mode server answers 422)."""
    return {"owner": owner} if owner is not None else {}


def _ttl_ms(ttl_ms: int | None) -> dict[str, Any]:
    return {} if ttl_ms is None else {"ttl_ms": ttl_ms}


def _wait_ms(wait_ms: int) -> dict[str, Any]:
    if wait_ms < 0:
        raise ValueError("wait_ms must be >= 0")
    return {"wait_ms": wait_ms} if wait_ms else {}


def _waiting_timeout(base: httpx.Timeout, wait_s: float) -> httpx.Timeout:
    """The client's timeout with the server's wait added to the read, so a waiting acquire is not cut off
    (the client's own when nothing waits)."""
    if not wait_s:
        return base
    read = None if base.read is None else base.read + wait_s
    return httpx.Timeout(connect=base.connect, read=read, write=base.write, pool=base.pool)


class _Base:
    """Configuration, breaker bookkeeping and response classification shared by both clients."""

    def __init__(
        self,
        *,
        retry_attempts: int,
        retry_timeout_s: float,
        breaker: CircuitBreaker | None,
        agent_id: str | None,
        token: str | None,
    ) -> None:
        self.retry_attempts = retry_attempts
        self.retry_timeout_s = retry_timeout_s
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        # With a token the server knows who we are: leases are the token's, and naming anyone else is a 403.
        self.agent_id = agent_id or (None if token else f"agent-{uuid.uuid4().hex[:12]}")

    @staticmethod
    def _auth(headers: dict[str, str] | None, token: str | None) -> dict[str, str]:
        return {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}

    def _retries(self, wait_s: float = 0.0) -> Any:
        """stamina's retries; a waiting acquire's own wait does not use up the time left for them."""
        return stamina.retry_context(
            on=_retry_hook,
            attempts=self.retry_attempts,
            timeout=self.retry_timeout_s + wait_s,
            wait_initial=0.05,
            wait_max=2.0,
        )

    @staticmethod
    def _headers(key: str | None) -> dict[str, str] | None:
        return {"Idempotency-Key": key} if key else None

    def _settle(self, response: httpx.Response, started: float, wait_s: float = 0.0) -> httpx.Response:
        """Record the attempt in the breaker (a 4xx means a healthy server) and raise typed errors. The time
        a waiting acquire was allowed to wait for the lock is not the server being slow."""
        elapsed = max(0.0, time.monotonic() - started - wait_s)
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

    def _failed(self, exc: BaseException, started: float, wait_s: float = 0.0) -> None:
        if isinstance(exc, httpx.TransportError):
            self.breaker.on_error(max(0.0, time.monotonic() - started - wait_s))
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
        retry_timeout_s: float = 10.0,
        breaker: CircuitBreaker | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
        agent_id: str | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(
            retry_attempts=retry_attempts,
            retry_timeout_s=retry_timeout_s,
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
        wait_s: float = 0.0,
    ) -> Any:
        key = str(uuid.uuid4()) if method == "POST" else None  # one key for every attempt of this command
        timeout = _waiting_timeout(self._http.timeout, wait_s)
        try:
            async for attempt in self._retries(wait_s):
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
                        self._failed(exc, started, wait_s)
                        raise
                    return self._settle(response, started, wait_s).json()
        except httpx.TransportError as exc:
            raise self._unreachable(exc, method, path) from exc
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def acquire(
        self, resource: str, owner: str | None = None, ttl_ms: int | None = None, wait_ms: int = 0
    ) -> LeaseInfo:
        """Take the lock; if it is held, the server waits up to ``wait_ms`` (at most its
        ``LOCKLEDGER_MAX_WAIT_MS``) for it to come free before raising ``LockHeld``."""
        body = {**_owner(owner), **_ttl_ms(ttl_ms), **_wait_ms(wait_ms)}
        path = f"/v1/locks/{resource}/acquire"
        return LeaseInfo.from_json(await self._request("POST", path, json=body, wait_s=wait_ms / 1000))

    async def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl_ms: int | None = None
    ) -> LeaseInfo:
        body = {**_owner(owner), "fencing_token": fencing_token, **_ttl_ms(ttl_ms)}
        return LeaseInfo.from_json(await self._request("POST", f"/v1/locks/{resource}/renew", json=body))

    async def release(self, resource: str, owner: str | None, fencing_token: int) -> Released:
        body = {**_owner(owner), "fencing_token": fencing_token}
        return Released.from_json(await self._request("POST", f"/v1/locks/{resource}/release", json=body))

    async def force_release(self, resource: str, reason: str) -> ForceReleased:
        data = await self._request("POST", f"/v1/locks/{resource}/force-release", json={"reason": reason})
        return ForceReleased.from_json(data)

    async def get_lock(self, resource: str) -> LockInfo:
        """The lock's state; ``NotFound`` if it was never locked."""
        return LockInfo.from_json(await self._request("GET", f"/v1/locks/{resource}"))

    async def list_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within_ms: int | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> LockPage:
        params = _clean(
            {"holder": holder, "prefix": prefix, "expiring_within_ms": expiring_within_ms, "cursor": cursor,
             "limit": limit}
        )  # fmt: skip
        data = await self._request("GET", "/v1/locks", params=params)
        return LockPage([LockInfo.from_json(i) for i in data["items"]], data["next_cursor"])

    async def iter_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within_ms: int | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[LockInfo]:
        """Every live lease matching the filters, following ``next_cursor`` page by page."""
        cursor: str | None = None
        while True:
            page = await self.list_locks(
                holder=holder,
                prefix=prefix,
                expiring_within_ms=expiring_within_ms,
                cursor=cursor,
                limit=limit,
            )
            for item in page.items:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def history(self, resource: str, after_version: int = 0, limit: int = 100) -> History:
        params = {"after_version": after_version, "limit": limit}
        data = await self._request("GET", f"/v1/locks/{resource}/history", params=params)
        return History(
            data["resource"], [HistoryEvent.from_json(e) for e in data["events"]], data["next_after_version"]
        )

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
        """A managed lease: ``async with client.lock("zone:A3", ttl=30, wait=5) as lease:``.

        See ``lockledger.lease`` for the renewal and loss rules; ``safety_margin`` is a fraction of ``ttl``.
        """
        return AsyncLease(self, resource, owner or self.agent_id, ttl, wait, on_lost, safety_margin)


# --- threads -------------------------------------------------------------------------------------------


class Client(_Base):
    """The blocking twin of ``AsyncClient``; ``with client.lock(...)`` renews from a background thread."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        retry_attempts: int = 5,
        retry_timeout_s: float = 10.0,
        breaker: CircuitBreaker | None = None,
        transport: httpx.BaseTransport | None = None,
        headers: dict[str, str] | None = None,
        agent_id: str | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(
            retry_attempts=retry_attempts,
            retry_timeout_s=retry_timeout_s,
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
        wait_s: float = 0.0,
    ) -> Any:
        key = str(uuid.uuid4()) if method == "POST" else None
        timeout = _waiting_timeout(self._http.timeout, wait_s)
        try:
            for attempt in self._retries(wait_s):
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
                        self._failed(exc, started, wait_s)
                        raise
                    return self._settle(response, started, wait_s).json()
        except httpx.TransportError as exc:
            raise self._unreachable(exc, method, path) from exc
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    def acquire(
        self, resource: str, owner: str | None = None, ttl_ms: int | None = None, wait_ms: int = 0
    ) -> LeaseInfo:
        """Take the lock; if it is held, the server waits up to ``wait_ms`` (at most its
        ``LOCKLEDGER_MAX_WAIT_MS``) for it to come free before raising ``LockHeld``."""
        body = {**_owner(owner), **_ttl_ms(ttl_ms), **_wait_ms(wait_ms)}
        path = f"/v1/locks/{resource}/acquire"
        return LeaseInfo.from_json(self._request("POST", path, json=body, wait_s=wait_ms / 1000))

    def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl_ms: int | None = None
    ) -> LeaseInfo:
        body = {**_owner(owner), "fencing_token": fencing_token, **_ttl_ms(ttl_ms)}
        return LeaseInfo.from_json(self._request("POST", f"/v1/locks/{resource}/renew", json=body))

    def release(self, resource: str, owner: str | None, fencing_token: int) -> Released:
        body = {**_owner(owner), "fencing_token": fencing_token}
        return Released.from_json(self._request("POST", f"/v1/locks/{resource}/release", json=body))

    def force_release(self, resource: str, reason: str) -> ForceReleased:
        data = self._request("POST", f"/v1/locks/{resource}/force-release", json={"reason": reason})
        return ForceReleased.from_json(data)

    def get_lock(self, resource: str) -> LockInfo:
        return LockInfo.from_json(self._request("GET", f"/v1/locks/{resource}"))

    def list_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within_ms: int | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> LockPage:
        params = _clean(
            {"holder": holder, "prefix": prefix, "expiring_within_ms": expiring_within_ms, "cursor": cursor,
             "limit": limit}
        )  # fmt: skip
        data = self._request("GET", "/v1/locks", params=params)
        return LockPage([LockInfo.from_json(i) for i in data["items"]], data["next_cursor"])

    def iter_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within_ms: int | None = None,
        limit: int | None = None,
    ) -> Iterator[LockInfo]:
        cursor: str | None = None
        while True:
            page = self.list_locks(
                holder=holder,
                prefix=prefix,
                expiring_within_ms=expiring_within_ms,
                cursor=cursor,
                limit=limit,
            )
            yield from page.items
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def history(self, resource: str, after_version: int = 0, limit: int = 100) -> History:
        params = {"after_version": after_version, "limit": limit}
        data = self._request("GET", f"/v1/locks/{resource}/history", params=params)
        return History(
            data["resource"], [HistoryEvent.from_json(e) for e in data["events"]], data["next_after_version"]
        )

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
        """A managed lease: ``with client.lock("zone:A3", ttl=30, wait=5) as lease:``."""
        return Lease(self, resource, owner or self.agent_id, ttl, wait, on_lost, safety_margin)
