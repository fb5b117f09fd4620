"""The state of one lock, as folded from its event stream."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from domain.value import value

Status = Literal["held", "free"]


def is_expired(expires_at: datetime, now: datetime) -> bool:
    """The expiry rule: a lease is over once the clock reaches its deadline (the deadline itself is
    already too late). The SQL that applies it (the reaper, waiters, the append's liveness check) uses
    ``projections/lock_state.py``'s translation of this one comparison."""
    return now >= expires_at


@value
class LockState:
    """What a decision needs to know about a lock.

    ``version`` is the stream version of the last event (0 for a lock never taken); the next fencing token
    is derived from it, which is why tokens are assigned under the same serialization as the decision.
    A ``held`` lease whose ``expires_at`` has passed is *lapsed*: no longer live, but its ``LOCK_EXPIRED``
    event may not have been appended yet (the reaper or the next command does that).
    ``handed_off_by`` names the giver of a lease handed off and not yet accepted or declined by its new
    holder (docs/decisions/0047-lease-hand-off.md); None otherwise.
    """

    resource: str
    version: int = 0
    status: Status = "free"
    owner: str | None = None
    fencing_token: int = 0
    ttl_ms: int | None = None
    expires_at: datetime | None = None
    ended_by: str | None = None
    handed_off_by: str | None = None

    def is_live(self, now: datetime) -> bool:
        return self.status == "held" and self.expires_at is not None and not is_expired(self.expires_at, now)

    def is_lapsed(self, now: datetime) -> bool:
        return self.status == "held" and self.expires_at is not None and is_expired(self.expires_at, now)

    def with_deadline(self, expires_at: datetime | None) -> LockState:
        """This state with the lease deadline its append stamped (a grant is decided without one)."""
        if expires_at == self.expires_at:
            return self
        return LockState(
            self.resource, self.version, self.status, self.owner, self.fencing_token, self.ttl_ms,
            expires_at, self.ended_by, self.handed_off_by,
        )  # fmt: skip


def initial_state(resource: str) -> LockState:
    return LockState(resource=resource)
