"""Events: the immutable facts of a lock's life.

Every event carries the owner, the fencing token and the lease deadline it knew, so the last event of a
stream determines the lock's state without reading older ones (projections and replay rely on it). A
grant (``LOCK_ACQUIRED``, ``LOCK_RENEWED``, ``LOCK_HANDED_OFF``) is decided with its TTL and no
deadline: the append stamps ``expires_at`` from the clock read where the decision is serialized
(:func:`stamp`, or the command statement in PostgreSQL), so the deadline is computed once, by the store.
Stored grants always carry it.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from typing import Any

from domain.timestamps import format_timestamp
from domain.value import value

LOCK_ACQUIRED = "LOCK_ACQUIRED"
LOCK_RENEWED = "LOCK_RENEWED"
LOCK_RELEASED = "LOCK_RELEASED"
LOCK_EXPIRED = "LOCK_EXPIRED"
LOCK_FORCE_RELEASED = "LOCK_FORCE_RELEASED"
LOCK_HANDED_OFF = "LOCK_HANDED_OFF"


@value
class LockAcquired:
    resource: str
    owner: str
    fencing_token: int
    ttl_ms: int
    expires_at: datetime | None  # None until the append stamps it
    type: str = LOCK_ACQUIRED


@value
class LockRenewed:
    resource: str
    owner: str
    fencing_token: int
    ttl_ms: int
    expires_at: datetime | None  # None until the append stamps it
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


@value
class LockHandedOff:
    """The holder ``from_owner`` (token ``from_token``) handed its live lease to ``owner``: it ends the
    giver's lease and begins the receiver's with a new ``fencing_token`` (this event's stream version),
    in one event, so no instant is without a holder. ``ttl_ms`` is the time given to accept."""

    resource: str
    owner: str
    fencing_token: int
    ttl_ms: int
    expires_at: datetime | None  # None until the append stamps it
    from_owner: str
    from_token: int
    type: str = LOCK_HANDED_OFF


Event = LockAcquired | LockRenewed | LockReleased | LockExpired | LockForceReleased | LockHandedOff

# Events whose lease deadline is computed from the TTL at the instant of the append.
GRANTING_EVENTS = frozenset({LOCK_ACQUIRED, LOCK_RENEWED, LOCK_HANDED_OFF})
# Grants that begin a lease (a new holder, a new fencing token): the lease's own start, where replay,
# holding_periods, agent_stats and lock_state's acquired_at find when, and for which saga step, it began.
LEASE_STARTS = frozenset({LOCK_ACQUIRED, LOCK_HANDED_OFF})

# The field of a payload that holds the lease deadline (stamped by the append for granting events).
DEADLINE_FIELD = "expires_at"

# Every payload's fields, per event type, and each field's type: what ``event_payload`` writes and
# ``event_from_payload`` reads. The SQL that writes or reads payloads (``eventstore/payloads.py``: the
# append's deadline stamp, the reaper's expiry, rebuild) is generated from these two tables.
PAYLOAD_FIELDS: dict[str, tuple[str, ...]] = {
    LOCK_ACQUIRED: ("owner", "fencing_token", DEADLINE_FIELD, "ttl_ms"),
    LOCK_RENEWED: ("owner", "fencing_token", DEADLINE_FIELD, "ttl_ms"),
    LOCK_RELEASED: ("owner", "fencing_token", DEADLINE_FIELD),
    LOCK_EXPIRED: ("owner", "fencing_token", DEADLINE_FIELD),
    LOCK_FORCE_RELEASED: ("owner", "fencing_token", DEADLINE_FIELD, "reason"),
    LOCK_HANDED_OFF: ("owner", "fencing_token", DEADLINE_FIELD, "ttl_ms", "from_owner", "from_token"),
}
PAYLOAD_TYPES: dict[str, type] = {
    "owner": str,
    "fencing_token": int,
    DEADLINE_FIELD: datetime,
    "ttl_ms": int,
    "reason": str,
    "from_owner": str,
    "from_token": int,
}

# The payload fields that hold an instant (ISO 8601 text in the stored JSON).
TIMESTAMP_FIELDS = frozenset(field for field, kind in PAYLOAD_TYPES.items() if kind is datetime)


def event_payload(event: Event) -> dict[str, Any]:
    """The JSON body stored in the log (the stream id and type live in their own columns); its keys are
    ``PAYLOAD_FIELDS[event.type]``, less the deadline of a grant the append has still to stamp."""
    payload: dict[str, Any] = {"owner": event.owner, "fencing_token": event.fencing_token}
    if event.expires_at is not None:  # a grant not yet appended has none: the append stamps it
        payload[DEADLINE_FIELD] = format_timestamp(event.expires_at)
    if isinstance(event, LockAcquired | LockRenewed | LockHandedOff):
        payload["ttl_ms"] = event.ttl_ms
    if isinstance(event, LockHandedOff):
        payload["from_owner"] = event.from_owner
        payload["from_token"] = event.from_token
    if isinstance(event, LockForceReleased):
        payload["reason"] = event.reason
    return payload


def stamp(events: list[Event], at: datetime) -> list[Event]:
    """``events`` as appended at instant ``at``: a grant's lease deadline is ``at`` plus its TTL.

    The one definition of a deadline. A store applies it with the clock read where it serializes the
    decision (the PostgreSQL statement writes the same sum, ``service/lock_store.py``).
    """
    return [
        type(event)(
            event.resource, event.owner, event.fencing_token, event.ttl_ms, deadline(at, event.ttl_ms)
        )
        if isinstance(event, LockAcquired | LockRenewed)
        else dataclasses.replace(event, expires_at=deadline(at, event.ttl_ms))
        if isinstance(event, LockHandedOff)
        else event
        for event in events
    ]


def deadline(at: datetime, ttl_ms: int) -> datetime:
    """The end of a lease of ``ttl_ms`` granted at ``at``."""
    return at + timedelta(milliseconds=ttl_ms)


def event_from_payload(resource: str, event_type: str, data: dict[str, Any]) -> Event:
    """Inverse of :func:`event_payload`, used by rebuild, history and replay."""
    expires_at = datetime.fromisoformat(data[DEADLINE_FIELD])
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
    if event_type == LOCK_HANDED_OFF:
        return LockHandedOff(
            resource, owner, token, int(data["ttl_ms"]), expires_at, str(data["from_owner"]),
            int(data["from_token"]),
        )  # fmt: skip
    if event_type == LOCK_FORCE_RELEASED:
        return LockForceReleased(resource, owner, token, expires_at, str(data.get("reason", "")))
    raise ValueError(f"unknown lock event type {event_type!r}")
