"""The sans-I/O half of the clients: what goes on the wire and how an answer is judged, shared by
``AsyncClient`` and its generated twin ``Client``, so the two cannot drift.

Here: the checks on resources and owners before anything is sent, the paths, bodies and queries, the
conversion of seconds to the server's ``*_ms`` fields, the timeouts, which errors a retry can fix, and
``ClientCore``: the configuration and circuit-breaker bookkeeping around every attempt. No I/O happens
here; the clients do the sending.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from datetime import datetime
from typing import Any

import httpx
import stamina

from lockledger.errors import LockLedgerError, Unavailable, ValidationError, error_from_response
from lockledger.replay import filters, instant, time_range
from lockledger_breaker import CircuitBreaker

__all__ = ["ClientCore", "check_owner", "check_resource"]


def refused(detail: str) -> ValidationError:
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
        raise refused(f"invalid resource {resource!r:.80}: {_RESOURCE_RULE}")
    return resource


# The server's rule for an owner (a lease holder, an agent's principal); it names a URL path segment in
# ``agent_history``.
_OWNER_RE = re.compile(r"[A-Za-z0-9._:@\-]{1,200}")


def check_owner(owner: str) -> str:
    """``owner`` if the server could accept it; else ``ValidationError`` before anything is sent."""
    if not isinstance(owner, str) or not _OWNER_RE.fullmatch(owner) or not owner.strip("."):
        raise refused(f"invalid owner {owner!r:.80}: 1-200 characters of A-Z, a-z, 0-9 and . _ : @ -")
    return owner


def lock_path(resource: str, action: str = "") -> str:
    """``/v1/locks/{resource}{action}``, the resource checked first."""
    return f"/v1/locks/{check_resource(resource)}{action}"


def shared_path(resource: str, action: str = "") -> str:
    """``/v1/shared-locks/{resource}{action}``, the resource checked first."""
    return f"/v1/shared-locks/{check_resource(resource)}{action}"


def shared_acquire_body(
    mode: str, limit: int | None, owner: str | None, ttl: float | None, wait: float
) -> dict[str, Any]:
    """A shared lock's acquire: ``mode`` ``shared`` or ``exclusive``, and the semaphore's ``limit``."""
    if mode not in ("shared", "exclusive"):
        raise refused(f"mode must be 'shared' or 'exclusive', not {mode!r:.40}")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000
    ):
        raise refused(f"limit must be a whole number from 1 to 10000, not {limit!r:.40}")
    return {"mode": mode, **({} if limit is None else {"limit": limit}), **acquire_body(owner, ttl, wait)}


def ms(name: str, seconds: float) -> int:
    """A duration in seconds as the server's whole milliseconds (its ``*_ms`` fields): the one place the
    SDK's unit meets the wire's."""
    if not math.isfinite(seconds) or seconds < 0:
        raise refused(f"{name} must be a finite number of seconds >= 0, not {seconds!r}")
    return round(seconds * 1000)


def owner_field(owner: str | None) -> dict[str, Any]:
    """Without an owner the server uses the token's principal (a dev-mode server answers 422)."""
    return {"owner": owner} if owner is not None else {}


def ttl_field(ttl: float | None) -> dict[str, Any]:
    """Without a ttl the server uses its default (acquire) or the lease's current one (renew)."""
    return {} if ttl is None else {"ttl_ms": ms("ttl", ttl)}


def wait_field(wait: float) -> dict[str, Any]:
    wait_ms = ms("wait", wait)
    return {"wait_ms": wait_ms} if wait_ms else {}


def acquire_body(owner: str | None, ttl: float | None, wait: float) -> dict[str, Any]:
    return {**owner_field(owner), **ttl_field(ttl), **wait_field(wait)}


def renew_body(owner: str | None, fencing_token: int, ttl: float | None) -> dict[str, Any]:
    return {**owner_field(owner), "fencing_token": fencing_token, **ttl_field(ttl)}


def release_body(owner: str | None, fencing_token: int) -> dict[str, Any]:
    return {**owner_field(owner), "fencing_token": fencing_token}


def handoff_body(
    owner: str | None, fencing_token: int, to: str, accept_within: float | None
) -> dict[str, Any]:
    """A hand-off to ``to``; without ``accept_within`` the server gives its default TTL to accept."""
    within = {} if accept_within is None else {"accept_within_ms": ms("accept_within", accept_within)}
    return {**owner_field(owner), "fencing_token": fencing_token, "to": check_owner(to), **within}


def locks_query(
    holder: str | None,
    prefix: str | None,
    expiring_within: float | None,
    cursor: str | None,
    limit: int | None,
) -> dict[str, Any]:
    within = None if expiring_within is None else ms("expiring_within", expiring_within)
    return filters(holder=holder, prefix=prefix, cursor=cursor, limit=limit, expiring_within_ms=within)


# Replay answers are read whole (every page): the largest page the server gives keeps round trips few.
PAGE = 1000
STATE_PAGE = 10_000  # the state at an instant comes in pages this large: a whole fleet in one
# An export filtered by type, owner or prefix may scan a long stretch of the log between two matches: the
# wait for the next line may be far longer than for an ordinary answer.
_STREAM_READ_TIMEOUT = 60.0


def state_query(at: datetime | str, prefix: str | None, owner: str | None) -> dict[str, Any]:
    return {"at": instant("at", at), **filters(prefix=prefix, owner=owner), "limit": STATE_PAGE}


def changes_query(
    from_: datetime | str, to: datetime | str, prefix: str | None, owner: str | None
) -> dict[str, Any]:
    return {"from": instant("from_", from_), "to": instant("to", to), **filters(prefix=prefix, owner=owner),
            "limit": PAGE}  # fmt: skip


def export_query(
    from_: datetime | str | None,
    to: datetime | str | None,
    type: str | None,
    owner: str | None,
    prefix: str | None,
) -> dict[str, Any]:
    return {**time_range(from_, to), **filters(type=type, owner=owner, prefix=prefix)}


def export_cut_off(exc: Exception, position: int, attempts: int) -> Unavailable:
    """The error for an export whose connections kept being cut before any new event (status 0)."""
    detail = (
        f"GET /v1/events: {attempts} connections in a row cut before a new event, after position"
        f" {position} ({type(exc).__name__}: {exc}); resume with after_position={position}"
    )
    return Unavailable(0, {"code": "unavailable", "detail": detail})


def feed_cut_off(connections: int, place: str | None) -> Unavailable:
    """The error for a change feed whose connections kept ending before any new event (status 0)."""
    detail = f"GET /v1/events/stream: {connections} connections in a row ended before a new event"
    return Unavailable(0, {"code": "unavailable", "detail": f"{detail}; resume from {place}"})


def streaming_timeout(base: httpx.Timeout) -> httpx.Timeout:
    """The client's timeout with a read long enough for a filtered stream's quiet stretches."""
    read = None if base.read is None else max(base.read, _STREAM_READ_TIMEOUT)
    return httpx.Timeout(connect=base.connect, read=read, write=base.write, pool=base.pool)


def waiting_timeout(base: httpx.Timeout, wait: float) -> httpx.Timeout:
    """The client's timeout with the server's wait added to the read, so a waiting acquire is not cut off
    (the client's own when nothing waits)."""
    if not wait:
        return base
    read = None if base.read is None else base.read + wait
    return httpx.Timeout(connect=base.connect, read=read, write=base.write, pool=base.pool)


def retry_hook(exc: Exception) -> bool | float:
    """stamina's ``on``: retry transport errors and 5xx; a Retry-After hint becomes the wait."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, Unavailable) and exc.retry_after is not None:
        return max(exc.retry_after, 0.05)
    return isinstance(exc, LockLedgerError) and exc.status >= 500


def request_headers(
    method: str, headers: dict[str, str] | None, idempotency_key: str | None
) -> dict[str, str]:
    """The headers of one command, every attempt alike: a POST without a chosen key gets a fresh one,
    chosen once before the first attempt, so a retry after a lost answer replays the stored answer."""
    key = idempotency_key or (str(uuid.uuid4()) if method == "POST" else None)
    return {**(headers or {}), **({"Idempotency-Key": key} if key else {})}


def unreachable(exc: httpx.TransportError, method: str, path: str) -> Unavailable:
    """The SDK's error for a request that never got an answer (raised ``from`` ``exc``); status 0, as no
    HTTP status was received."""
    try:
        url = str(exc.request.url)
    except RuntimeError:  # an error raised without its request
        url = path
    detail = f"{method} {url}: no answer after retries ({type(exc).__name__}: {exc})"
    return Unavailable(0, {"code": "unavailable", "detail": detail})


def replayed(response: httpx.Response) -> bool:
    """Whether the server answered from a stored response (the Idempotency-Key was seen before)."""
    header: str | None = response.headers.get("Idempotent-Replayed")
    return header == "true"


class ClientCore:
    """Configuration, retries and breaker bookkeeping shared by both clients (no I/O)."""

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
            on=retry_hook,
            attempts=self.retry_attempts,
            timeout=self.retry_timeout + wait,
            wait_initial=0.05,
            wait_max=2.0,
        )

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

    def _failed(self, exc: BaseException, started: float, wait: float = 0.0) -> None:
        if isinstance(exc, httpx.TransportError):
            self.breaker.on_error(max(0.0, time.monotonic() - started - wait))
        else:  # cancelled, or a bug of ours: says nothing about the server's health
            self.breaker.release_permission()
