"""Typed exceptions for the SDK: one class per problem+json ``code`` the server sends.

Callers branch on the type (``except LockHeld``) instead of parsing bodies, and the raw problem stays on
``.problem`` for logging. A code without a class of its own here (``conflict``, ``payload_too_large``...)
is raised as ``LockLedgerError`` with its ``code``. Importing this module pulls in no server code.

The server never answers 409 ``idempotency_key_in_progress``: a retry under a key whose first request is
still being processed waits for that request and gets its stored answer (``Idempotent-Replayed: true``),
so the SDK has no class for it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx

from lockledger_breaker import CircuitOpen

__all__ = [
    "CircuitOpen",
    "Forbidden",
    "IdempotencyKeyReused",
    "LeaseExpired",
    "LockHeld",
    "LockLedgerError",
    "LockLost",
    "NotFound",
    "NotHolder",
    "Unauthorized",
    "Unavailable",
    "ValidationError",
    "error_from_response",
]


def parse_datetime(value: Any) -> datetime | None:
    """ISO 8601 from the server (always with an offset) to an aware datetime; None stays None."""
    if value is None:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


class LockLedgerError(Exception):
    """A refusal or failure reported by the server, or found by the SDK itself: then ``status`` is 0
    (``LockLost``; ``Unavailable`` when no answer came; ``ValidationError`` for an argument the SDK
    refuses before sending anything)."""

    code = "error"

    def __init__(self, status: int, problem: dict[str, Any] | None = None, detail: str | None = None) -> None:
        self.status = status
        self.problem: dict[str, Any] = dict(problem or {})
        self.code = str(self.problem.get("code", type(self).code))
        self.detail = detail or str(self.problem.get("detail", "")) or self.code
        self.resource: str | None = self.problem.get("resource")
        super().__init__(f"{self.status} {self.code}: {self.detail}")


class LockHeld(LockLedgerError):
    """Someone (possibly this very owner: locks are not re-entrant) holds a live lease."""

    code = "lock_held"

    def __init__(self, status: int, problem: dict[str, Any] | None = None, detail: str | None = None) -> None:
        super().__init__(status, problem, detail)
        self.holder: str | None = self.problem.get("holder")
        self.expires_at: datetime | None = parse_datetime(self.problem.get("expires_at"))
        token = self.problem.get("fencing_token")
        self.fencing_token: int | None = int(token) if token is not None else None


class NotHolder(LockLedgerError):
    """The owner/token is not the latest grant, or the lease was released or force-released."""

    code = "not_holder"


class LeaseExpired(LockLedgerError):
    """This lease reached its deadline; it is never resurrected."""

    code = "lease_expired"

    def __init__(self, status: int, problem: dict[str, Any] | None = None, detail: str | None = None) -> None:
        super().__init__(status, problem, detail)
        self.expired_at: datetime | None = parse_datetime(self.problem.get("expired_at"))


class IdempotencyKeyReused(LockLedgerError):
    code = "idempotency_key_reused"


class ValidationError(LockLedgerError, ValueError):
    """The request is malformed: answered 422 by the server, or refused by the SDK before any request
    (status 0), e.g. a resource that is not 1-200 characters of ``[A-Za-z0-9._:-]``. Also a ``ValueError``."""

    code = "validation_error"


class NotFound(LockLedgerError):
    code = "not_found"


class Unauthorized(LockLedgerError):
    code = "unauthorized"


class Forbidden(LockLedgerError):
    code = "forbidden"


class Unavailable(LockLedgerError):
    """The server (or its database) cannot answer now; ``retry_after`` (seconds) is its hint, if any.

    Also raised when no answer came at all (connection refused or reset, a timeout) once the client's
    retries are spent: then ``status`` is 0 and the httpx error is the ``__cause__``.
    """

    code = "unavailable"

    def __init__(
        self,
        status: int,
        problem: dict[str, Any] | None = None,
        detail: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, problem, detail)
        self.retry_after = retry_after


class LockLost(LockLedgerError):
    """Raised by the SDK (not the server) once a lease can no longer be guaranteed to be held.

    Stop touching the protected resource: another agent may hold it soon, or already.
    """

    code = "lock_lost"

    def __init__(self, resource: str, fencing_token: int, reason: str) -> None:
        super().__init__(0, {"code": "lock_lost", "resource": resource, "detail": reason}, reason)
        self.fencing_token = fencing_token
        self.reason = reason


_BY_CODE: dict[str, type[LockLedgerError]] = {
    cls.code: cls
    for cls in (
        LockHeld,
        NotHolder,
        LeaseExpired,
        IdempotencyKeyReused,
        ValidationError,
        NotFound,
        Unauthorized,
        Forbidden,
    )
}


def _retry_after(response: httpx.Response) -> float | None:
    """Only the delta-seconds form; an HTTP-date is rare from this server and not worth a parser."""
    value = response.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def error_from_response(response: httpx.Response) -> LockLedgerError:
    """The typed exception for an error response (problem+json, or anything else a proxy might send)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    problem: dict[str, Any] = body if isinstance(body, dict) else {"detail": response.text[:200]}
    code = problem.get("code")
    status = response.status_code
    if code == "unavailable" or status == 503:
        return Unavailable(status, problem, retry_after=_retry_after(response))
    cls = _BY_CODE.get(str(code)) if code is not None else None
    if cls is None:
        by_status = {404: NotFound, 401: Unauthorized, 403: Forbidden, 422: ValidationError}
        cls = by_status.get(status, LockLedgerError)
    return cls(status, problem)
