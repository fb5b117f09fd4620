"""Events: the immutable facts of a lock's life.

Every event carries the owner, the fencing token and the lease deadline it knew, so the last event of a
stream determines the lock's state without reading older ones (projections and replay rely on it).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from domain.value import value

LOCK_ACQUIRED = "LOCK_ACQUIRED"
LOCK_RENEWED = "LOCK_RENEWED"
LOCK_RELEASED = "LOCK_RELEASED"
LOCK_EXPIRED = "LOCK_EXPIRED"
LOCK_FORCE_RELEASED = "LOCK_FORCE_RELEASED"


@value
class LockAcquired:
    resource: str
    owner: str
    fencing_token: int
    ttl_ms: int
    expires_at: datetime
    type: str = LOCK_ACQUIRED


@value
class LockRenewed:
    resource: str
    owner: str
    fencing_token: int
    ttl_ms: int
    expires_at: datetime
    type: str = LOCK_RENEWED


@value
class LockReleased:
    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    type: str = LOCK_RELEASED


@value
class LockExpired:
    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    type: str = LOCK_EXPIRED


@value
class LockForceReleased:
    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    reason: str
    type: str = LOCK_FORCE_RELEASED


Event = LockAcquired | LockRenewed | LockReleased | LockExpired | LockForceReleased

# Events whose lease deadline is computed from the TTL at the instant of the append.
GRANTING_EVENTS = frozenset({LOCK_ACQUIRED, LOCK_RENEWED})

# The payload fields that hold an instant (ISO 8601 text in the stored JSON).
TIMESTAMP_FIELDS = frozenset({"expires_at"})


def event_payload(event: Event) -> dict[str, Any]:
    """The JSON body stored in the log (the stream id and type live in their own columns)."""
    payload: dict[str, Any] = {
        "owner": event.owner,
        "fencing_token": event.fencing_token,
        "expires_at": event.expires_at.isoformat(),
    }
    if isinstance(event, LockAcquired | LockRenewed):
        payload["ttl_ms"] = event.ttl_ms
    if isinstance(event, LockForceReleased):
        payload["reason"] = event.reason
    return payload


def event_from_payload(resource: str, event_type: str, data: dict[str, Any]) -> Event:
    """Inverse of :func:`event_payload`, used by rebuild, history and replay."""
    expires_at = datetime.fromisoformat(data["expires_at"])
    owner = str(data["owner"])
    token = int(data["fencing_token"])
    if event_type == LOCK_ACQUIRED:
        return LockAcquired(resource, owner, token, int(data["ttl_ms"]), expires_at)
    if event_type == LOCK_RENEWED:
        return LockRenewed(resource, owner, token, int(data["ttl_ms"]), expires_at)
    if event_type == LOCK_RELEASED:
        return LockReleased(resource, owner, token, expires_at)
    if event_type == LOCK_EXPIRED:
        return LockExpired(resource, owner, token, expires_at)
    if event_type == LOCK_FORCE_RELEASED:
        return LockForceReleased(resource, owner, token, expires_at, str(data.get("reason", "")))
    raise ValueError(f"unknown lock event type {event_type!r}")
