"""Results and query helpers of the replay API: the fleet's leases at a past instant, what changed
between two instants, an agent's history and the event export.

Times go out as the server writes them (RFC 3339 in UTC with microseconds and ``Z``) and come back as
aware datetimes. A naive datetime, or a string without an offset, is refused before anything is sent:
"09:30" means a different instant on every machine, and an investigation must not depend on where the
investigator sits. Importing this module pulls in no server code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from lockledger.errors import ValidationError, parse_datetime
from lockledger.event import Event, required_datetime

__all__ = [
    "AgentEvent",
    "AgentHistory",
    "Change",
    "Changes",
    "Event",
    "ExportedEvent",
    "ReplayLease",
    "ReplayState",
]


def _refused(detail: str) -> ValidationError:
    return ValidationError(0, {"code": "validation_error", "detail": detail})


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


# RFC 3339's date-time: a full date, a full time and an offset (``Z`` or ``±hh:mm``); "T" or a space.
_RFC3339_RE = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.(?P<fraction>\d+))?(?:[Zz]|[+-]\d{2}:\d{2})", re.ASCII
)
_MICROSECOND_DIGITS = 6


def instant(name: str, value: datetime | str) -> str:
    """``value`` as the server's timestamp text; ``ValidationError`` (a ``ValueError``) for what the
    server would refuse with 422: a naive datetime, a string that is not an RFC 3339 date-time with an
    offset, more than six fractional digits that are not zeros (``.1234567`` would be cut to
    microseconds), or an instant outside years 1 to 9999 in UTC (``0001-01-01T00:00:00+14:00``)."""
    if isinstance(value, str):
        text = value.strip()
        match = _RFC3339_RE.fullmatch(text)
        if match is None:
            raise _refused(
                f"{name} must be an RFC 3339 date-time with an offset, e.g. 2026-05-05T09:30:00Z"
                f" or 2026-05-05T11:30:00+02:00, not {value!r:.60}"
            )
        fraction = match["fraction"] or ""
        if fraction[_MICROSECOND_DIGITS:].strip("0"):
            raise _refused(
                f"{name} has {len(fraction)} fractional digits; an instant has at most"
                f" {_MICROSECOND_DIGITS} (microseconds): {value!r:.60}"
            )
        if len(fraction) > _MICROSECOND_DIGITS:
            start, end = match.span("fraction")
            text = text[: start + _MICROSECOND_DIGITS] + text[end:]
        try:
            parsed = datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
        except ValueError as exc:
            raise _refused(f"{name} is not a valid date-time: {value!r:.60} ({exc})") from None
    elif isinstance(value, datetime):
        parsed = value
    else:
        raise _refused(f"{name} must be a datetime or an RFC 3339 string, not {type(value).__name__}")
    if parsed.utcoffset() is None:
        raise _refused(f"{name} is a naive datetime; give it a time zone (e.g. tzinfo=datetime.UTC)")
    try:
        utc = parsed.astimezone(UTC)
    except OverflowError:
        raise _refused(f"{name} is outside years 1 to 9999 in UTC: {value!s:.60}") from None
    return utc.isoformat(timespec="microseconds").replace("+00:00", "Z")


def time_range(from_: datetime | str | None, to: datetime | str | None) -> dict[str, str]:
    """The ``from``/``to`` query parameters for the bounds given."""
    params: dict[str, str] = {}
    if from_ is not None:
        params["from"] = instant("from_", from_)
    if to is not None:
        params["to"] = instant("to", to)
    return params


def filters(**values: Any) -> dict[str, Any]:
    """The query parameters that were given (None means: no such filter)."""
    return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class ReplayLease:
    """A lease live at the instant asked about; ``expires_at`` is its deadline as known then. A grant of a
    shared lock (``read_lock``, ``write_lock``, ``semaphore``) has its ``mode``, ``shared`` or
    ``exclusive``, and its lock's ``limit`` (a semaphore's permits); both are None for a mutex lease."""

    resource: str
    owner: str
    fencing_token: int
    acquired_at: datetime | None  # None: its acquire is in an archived partition of the server's log
    expires_at: datetime
    saga_id: str | None = None  # the saga, and its step, the lease was acquired for
    saga_step: str | None = None
    reservation_id: str | None = None  # the reservation the lease was taken in (``client.reserve``)
    mode: str | None = None
    limit: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReplayLease:
        limit = d.get("limit")
        return cls(
            d["resource"], d["owner"], int(d["fencing_token"]), parse_datetime(d.get("acquired_at")),
            required_datetime(d["expires_at"]), d.get("saga_id"), d.get("saga_step"), d.get("reservation_id"),
            d.get("mode"), None if limit is None else int(limit),
        )  # fmt: skip


@dataclass(frozen=True)
class ReplayState:
    """Every lease live at ``at`` (by resource); ``position`` is the global position of the last event
    recorded at or before ``at`` (0 if none), the point in the log this state corresponds to."""

    at: datetime
    position: int
    locks: list[ReplayLease]

    @classmethod
    def from_json(cls, first_page: dict[str, Any], locks: list[ReplayLease]) -> ReplayState:
        """The state whose first page was ``first_page``, with the leases of every page."""
        return cls(required_datetime(first_page["at"]), int(first_page["position"]), locks)


@dataclass(frozen=True)
class Change:
    """An event recorded in the range, or a ``LEASE_LAPSED``: a deadline that passed in the range with
    nothing recorded for that lease (then ``position`` and ``version`` are None and ``at`` is the
    deadline)."""

    at: datetime
    type: str
    resource: str
    owner: str | None
    fencing_token: int | None
    position: int | None
    version: int | None
    data: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Change:
        return cls(
            required_datetime(d["at"]), d["type"], d["resource"], d.get("owner"),
            _int_or_none(d.get("fencing_token")), _int_or_none(d.get("position")),
            _int_or_none(d.get("version")), d.get("data") or {},
        )  # fmt: skip


@dataclass(frozen=True)
class Changes:
    """What changed after ``from_`` up to and including ``to``, in time order: the state at ``to`` is the
    state at ``from_`` with these applied."""

    from_: datetime
    to: datetime
    changes: list[Change]

    @classmethod
    def from_json(cls, first_page: dict[str, Any], changes: list[Change]) -> Changes:
        """The range whose first page was ``first_page``, with the changes of every page."""
        return cls(required_datetime(first_page["from"]), required_datetime(first_page["to"]), changes)


@dataclass(frozen=True)
class AgentHistory:
    """One page of an agent's events across every resource; ``next_after_position`` continues it."""

    owner: str
    events: list[Event]
    next_after_position: int | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AgentHistory:
        return cls(d["owner"], [Event.from_json(e) for e in d["events"]], d["next_after_position"])


# The log's one event record, by the names the replay API's results had for it.
AgentEvent = Event
ExportedEvent = Event
