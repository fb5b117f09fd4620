"""Application-level failures that are not lock-domain rejections."""

from __future__ import annotations


class ServiceError(Exception):
    code = "service_error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class IdempotencyKeyReused(ServiceError):
    """The key was already used for a different request (IETF httpapi idempotency draft: 422)."""

    code = "idempotency_key_reused"


class Unavailable(ServiceError):
    """The database cannot be reached, a resource is too contended to decide in bounded time, or the server
    is shutting down while a request waits (503)."""

    code = "unavailable"

    def __init__(self, detail: str, retry_after_s: int = 1) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class Conflict(ServiceError):
    """A request that contradicts stored state outside the lock domain (a token name's role) (409)."""

    code = "conflict"


class Unauthorized(ServiceError):
    """No bearer token, or one that is unknown or revoked (401 with ``WWW-Authenticate: Bearer``)."""

    code = "unauthorized"


class Forbidden(ServiceError):
    """The caller is known but its role, or the lease's owner, does not allow this (403)."""

    code = "forbidden"
