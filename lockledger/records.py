"""The typed results of the lock API, as both clients return them.

Durations are seconds (floats) and instants aware datetimes: the server's ``*_ms`` fields and RFC 3339
texts are converted here, at the HTTP boundary only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lockledger.errors import parse_datetime
from lockledger.event import Event, required_datetime

__all__ = [
    "ForceReleased",
    "HandedOff",
    "History",
    "LeaseInfo",
    "LockInfo",
    "LockPage",
    "QueuedAcquire",
    "Released",
    "Reply",
]


def _seconds(ms: Any) -> float:
    return int(ms) / 1000


@dataclass(frozen=True)
class Reply:
    """A decoded answer of ``request``: its JSON body, and whether the server replayed a stored answer
    (``Idempotent-Replayed: true``: the same Idempotency-Key was seen before)."""

    data: Any
    replayed: bool


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
            d["resource"], d["owner"], int(d["fencing_token"]), required_datetime(d["expires_at"]),
            _seconds(d["ttl_ms"]),
        )  # fmt: skip


@dataclass(frozen=True)
class HandedOff:
    """A hand-off: ``owner`` holds the lease from now on with ``fencing_token`` and must accept it before
    ``expires_at`` (``accept_within`` seconds after the hand-off); the giver's ``from_token`` is over."""

    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    accept_within: float
    from_owner: str
    from_token: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HandedOff:
        return cls(
            d["resource"], d["owner"], int(d["fencing_token"]), required_datetime(d["expires_at"]),
            _seconds(d["accept_within_ms"]), d["from_owner"], int(d["from_token"]),
        )  # fmt: skip


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
class QueuedAcquire:
    """An acquire waiting for a lock: who, since when, and when its wait (and its place) ends."""

    owner: str
    since: datetime
    deadline: datetime

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QueuedAcquire:
        return cls(d["owner"], required_datetime(d["since"]), required_datetime(d["deadline"]))


@dataclass(frozen=True)
class LockInfo:
    """A lock's projected state: ``status`` is ``held``, ``free`` or ``expired`` (lapsed, not yet reaped);
    ``ttl`` is the last grant's lease length in seconds; ``handed_off_by`` the giver of a hand-off the
    holder has not yet accepted or declined; ``queue`` the acquires waiting for it, first in line first
    (``get_lock`` only: lists leave it empty), ``queued`` how many there are (lists too);
    ``reservation_id`` the reservation the live lease was taken in (``client.reserve``)."""

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
    handed_off_by: str | None = None
    queue: tuple[QueuedAcquire, ...] = ()
    reservation_id: str | None = None
    queued: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LockInfo:
        return cls(
            d["resource"], d["status"], d.get("owner"), int(d["fencing_token"]),
            None if d.get("ttl_ms") is None else _seconds(d["ttl_ms"]),
            parse_datetime(d.get("expires_at")), parse_datetime(d.get("acquired_at")),
            required_datetime(d["updated_at"]), int(d["version"]), d.get("ended_by"),
            d.get("handed_off_by"),
            tuple(QueuedAcquire.from_json(q) for q in d.get("queue") or ()),
            d.get("reservation_id"), int(d.get("queued") or 0),
        )  # fmt: skip


@dataclass(frozen=True)
class LockPage:
    items: list[LockInfo]
    next_cursor: str | None


@dataclass(frozen=True)
class History:
    """One page of a resource's events; ``next_after_version`` continues it (None: done)."""

    resource: str
    events: list[Event]
    next_after_version: int | None

    @classmethod
    def from_json(cls, d: dict[str, Any], *, shared: bool = False) -> History:
        """A page as the server writes it; ``shared`` for a shared lock's, whose events are on the stream
        ``shared/<resource>`` (as an agent's history and the export name them)."""
        resource = d["resource"]
        stream = f"shared/{resource}" if shared else resource
        events = [Event.from_json(e, stream=stream) for e in d["events"]]
        return cls(resource, events, d["next_after_version"])
