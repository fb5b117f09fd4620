"""Domain errors: the reasons a lock command is rejected.

Each carries a stable machine-readable ``code`` so the API can map it to a problem+json response
without the domain knowing anything about HTTP.
"""

from __future__ import annotations

from datetime import datetime

from domain.timestamps import format_timestamp


class DomainError(Exception):
    """A command that the current state of the lock does not allow."""

    code: str = "domain_error"

    def __init__(self, resource: str, detail: str) -> None:
        super().__init__(detail)
        self.resource = resource
        self.detail = detail


class LockHeld(DomainError):
    """Another owner (or the same owner, locks are not re-entrant) holds a live lease. ``due_in_s``: how
    long until the refusal may be overturned by the clock alone (the lease's deadline), when known; a
    waiting acquire tries again then even if nothing wakes it."""

    code = "lock_held"

    def __init__(
        self,
        resource: str,
        holder: str,
        expires_at: datetime,
        fencing_token: int,
        due_in_s: float | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(
            resource, detail or f"{resource} is held by {holder} until {format_timestamp(expires_at)}"
        )
        self.holder = holder
        self.expires_at = expires_at
        self.fencing_token = fencing_token
        self.due_in_s = due_in_s


class NotHolder(DomainError):
    """The caller's owner id or fencing token is not the current lease's."""

    code = "not_holder"


class NotOwner(NotHolder):
    """The lease belongs to another owner. Without authentication this is just ``not_holder`` (anyone may
    claim any owner id); with it, the API answers 403: the caller is authenticated as someone else."""

    def __init__(self, resource: str, owner: str, holder: str) -> None:
        super().__init__(resource, f"{owner} does not hold {resource}; {holder} does")
        self.owner = owner
        self.holder = holder


class LeaseExpired(DomainError):
    """The caller's lease reached its deadline; it can never be renewed or released again."""

    code = "lease_expired"

    def __init__(self, resource: str, expired_at: datetime) -> None:
        super().__init__(resource, f"the lease on {resource} expired at {format_timestamp(expired_at)}")
        self.expired_at = expired_at


class InvalidCommand(DomainError):
    """A command whose own fields are out of bounds (bad resource name, TTL out of range)."""

    code = "validation_error"
