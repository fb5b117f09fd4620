"""Request and response bodies (pydantic v2): the API's contract, also shown in the OpenAPI at /docs."""

from __future__ import annotations

import contextlib
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
)

from domain.events import TIMESTAMP_FIELDS
from domain.resource import OWNER_PATTERN
from domain.timestamps import format_timestamp

# Every datetime in an answer, in the one shape of domain/timestamps.py (pydantic's own leaves out the
# fraction when it is zero); still documented as an RFC 3339 date-time.
Timestamp = Annotated[
    datetime,
    PlainSerializer(format_timestamp, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}, mode="serialization"),
]

# RFC 3339's date-time with an offset ("T", "t" or a space between date and time); ASCII digits only.
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.(?P<fraction>\d+))?(?:[Zz]|[+-]\d{2}:\d{2})", re.ASCII
)
MICROSECOND_DIGITS = 6  # what PostgreSQL's timestamptz and Python's datetime keep


def _rfc3339(value: object) -> object:
    """Only RFC 3339 text with an offset is an instant here: pydantic would also read ``0.5`` as one.
    More than six fractional digits are refused unless the extra ones are zeros (pydantic would cut
    them off, and ``.9999999`` would silently become ``.999999``)."""
    if not isinstance(value, str):
        return value
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise ValueError("an RFC 3339 date-time with an offset is expected, e.g. 2026-05-05T14:02:07Z")
    fraction = match["fraction"]
    if fraction is None or len(fraction) <= MICROSECOND_DIGITS:
        return value
    if fraction[MICROSECOND_DIGITS:].strip("0"):
        raise ValueError(
            f"an instant has at most {MICROSECOND_DIGITS} fractional digits (microseconds); "
            f"{len(fraction)} were sent"
        )
    start, end = match.span("fraction")
    return value[: start + MICROSECOND_DIGITS] + value[end:]


def _in_utc(value: datetime) -> datetime:
    """The instant in UTC. One that UTC cannot write (before year 1 or after 9999, as with
    ``0001-01-01T00:00:00+14:00``) is refused, like any other instant out of range."""
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the instant is outside years 1 to 9999 in UTC") from None


# An instant a client sends in a query: RFC 3339 with an offset (a naive time names no instant).
Instant = Annotated[AwareDatetime, BeforeValidator(_rfc3339), AfterValidator(_in_utc)]

Owner = Field(
    default=None,
    pattern=OWNER_PATTERN,
    min_length=1,
    max_length=200,
    description="The agent holding the lease. With authentication it is the token's name: leave it out, or"
    " send that name (anything else is 403). Required in dev mode.",
)


def _whole_number(value: object) -> object:
    """JSON has one number type: ``373.0`` is the integer 373 (JSON Schema's ``integer`` says so too), so
    a client whose encoder writes floats is not refused. Strings, booleans and fractions still are."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WholeNumber = Annotated[int, BeforeValidator(_whole_number)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "1500" is not a TTL


class AcquireRequest(_Body):
    owner: str | None = Owner
    ttl_ms: WholeNumber | None = Field(
        default=None, description="Lease length; the server default (30 s) if omitted."
    )
    wait_ms: WholeNumber = Field(
        default=0,
        ge=0,
        le=2**31,
        description="If the lock is held, wait up to this long for it to come free (the server's"
        " `LOCKLEDGER_MAX_WAIT_MS` at most, 30 s by default) before answering 409 `lock_held`. Waiters"
        " on one server process are served in arrival order. 0: answer at once.",
    )


class RenewRequest(_Body):
    owner: str | None = Owner
    fencing_token: WholeNumber = Field(ge=1, le=2**62)
    ttl_ms: WholeNumber | None = Field(
        default=None, description="New lease length; the current one if omitted."
    )


class ReleaseRequest(_Body):
    owner: str | None = Owner
    fencing_token: WholeNumber = Field(ge=1, le=2**62)


class HandOffRequest(_Body):
    owner: str | None = Owner
    fencing_token: WholeNumber = Field(ge=1, le=2**62, description="The giver's token: its live lease.")
    to: str = Field(
        pattern=OWNER_PATTERN,
        min_length=1,
        max_length=200,
        description="The agent that receives the lease (another than the giver).",
    )
    accept_within_ms: WholeNumber | None = Field(
        default=None,
        description="How long the receiver has to accept (bounded like `ttl_ms`); the server's default"
        " TTL (30 s) if omitted. Unaccepted, the lease lapses then.",
    )


class AcceptRequest(_Body):
    owner: str | None = Owner
    ttl_ms: WholeNumber | None = Field(
        default=None, description="Lease length from now on; the server default (30 s) if omitted."
    )


class DeclineRequest(_Body):
    owner: str | None = Owner


class ForceReleaseRequest(_Body):
    # No NUL: PostgreSQL text and jsonb cannot store it, so it would fail the append with a 500.
    reason: str = Field(
        min_length=1, max_length=1000, pattern=r"^[^\x00]*$", description="Why an operator ended the lease."
    )


class Lease(BaseModel):
    resource: str
    owner: str
    fencing_token: int = Field(
        description="Pass it to every downstream write; reject writes with older ones."
    )
    expires_at: Timestamp = Field(description="Deadline by the database clock.")
    ttl_ms: int


class HandedOff(BaseModel):
    resource: str
    owner: str = Field(description="The receiver: the holder from the hand-off on.")
    fencing_token: int = Field(description="The receiver's token; the giver's is refused from now on.")
    expires_at: Timestamp = Field(description="The receiver must accept before this deadline.")
    accept_within_ms: int
    from_owner: str = Field(description="The giver.")
    from_token: int = Field(description="The giver's token, which the hand-off ended.")


class Released(BaseModel):
    resource: str
    owner: str
    fencing_token: int
    released: bool


class ForceReleased(BaseModel):
    resource: str
    released: bool
    owner: str | None = None
    fencing_token: int | None = None
    event: str | None = None
    reason: str | None = None


class QueuedAcquire(BaseModel):
    owner: str
    since: Timestamp = Field(description="When it joined the queue (database clock).")
    deadline: Timestamp = Field(description="When its wait ends, and its place with it.")


class LockInfo(BaseModel):
    resource: str
    status: str = Field(
        description="held, free, or expired (deadline passed, LOCK_EXPIRED not yet appended)."
    )
    owner: str | None
    fencing_token: int
    ttl_ms: int | None
    expires_at: Timestamp | None
    acquired_at: Timestamp | None
    updated_at: Timestamp
    version: int
    ended_by: str | None
    saga_id: str | None = Field(
        default=None, description="The saga the live lease was acquired in (`X-Saga-ID`); null otherwise."
    )
    saga_step: str | None = Field(
        default=None, description="The saga step the live lease was acquired for (`X-Saga-Step`)."
    )
    handed_off_by: str | None = Field(
        default=None,
        description="The giver of a hand-off the holder has not yet accepted or declined; null otherwise.",
    )
    reservation_id: str | None = Field(
        default=None,
        description="The reservation the live lease was taken in (`POST /v1/reservations`); null otherwise.",
    )
    queued: int = Field(default=0, description="How many acquires wait in this lock's fair queue.")
    queue: list[QueuedAcquire] = Field(
        default_factory=list,
        description="The acquires waiting for this lock, first in line first; the next grant is the"
        " first's. Shown by `GET /v1/locks/{resource}` only (empty in lists).",
    )


class LockList(BaseModel):
    at: Timestamp = Field(description="The database time the list is as of (its snapshot's).")
    items: list[LockInfo]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


def _event_data(data: dict[str, Any]) -> dict[str, Any]:
    """An event's data with its instants in the answers' one shape: the log keeps them as they were
    written (the hash chain covers those bytes), which is not always that shape."""
    rendered = dict(data)
    for key in TIMESTAMP_FIELDS & rendered.keys():
        value = rendered[key]
        if isinstance(value, str):
            with contextlib.suppress(ValueError):  # not an instant after all: shown as stored
                rendered[key] = format_timestamp(datetime.fromisoformat(value))
    return rendered


class HistoryEvent(BaseModel):
    position: int
    version: int
    event_id: str
    type: str
    data: Annotated[dict[str, Any], PlainSerializer(_event_data, when_used="json")]
    metadata: dict[str, Any]
    recorded_at: Timestamp


class History(BaseModel):
    resource: str
    events: list[HistoryEvent]
    next_after_version: int | None


class ReplayLease(BaseModel):
    resource: str
    owner: str
    fencing_token: int
    acquired_at: Timestamp | None = Field(
        description="When the lease began; null when its acquire is in an archived partition (a lease renewed"
        " since before the live log begins)."
    )
    expires_at: Timestamp = Field(description="The deadline as known at the instant: the last grant's.")
    saga_id: str | None = Field(default=None, description="The saga the lease was acquired for, if any.")
    saga_step: str | None = None
    reservation_id: str | None = Field(
        default=None, description="The reservation the lease was taken in, if any."
    )
    mode: Literal["shared", "exclusive"] | None = Field(
        default=None,
        description="A shared-lock grant's mode (`/v1/shared-locks`); null for a mutex lease, and for a"
        " grant whose acquire is in an archived partition.",
    )
    limit: int | None = Field(
        default=None, description="A shared-lock grant's limit (a semaphore's permits); null otherwise."
    )


class ReplayState(BaseModel):
    at: Timestamp
    position: int = Field(
        description="Global position of the last event recorded at or before `at` (0: none)."
    )
    locks: list[ReplayLease]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class Change(BaseModel):
    at: Timestamp = Field(
        description="When the event was recorded, or when the lapsed lease's deadline passed."
    )
    type: str = Field(description="The event type, or `LEASE_LAPSED` for a deadline that passed unrecorded.")
    resource: str
    owner: str | None
    fencing_token: int | None
    position: int | None = Field(description="null for `LEASE_LAPSED`, which no event records (yet).")
    version: int | None
    data: Annotated[dict[str, Any], PlainSerializer(_event_data, when_used="json")]


class Changes(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    from_: Timestamp = Field(alias="from")
    to: Timestamp
    changes: list[Change]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class AgentEvent(HistoryEvent):
    resource: str


class AgentHistory(BaseModel):
    owner: str
    events: list[AgentEvent]
    next_after_position: int | None


class Problem(BaseModel):
    """RFC 9457 problem details; ``code`` is stable and machine-readable."""

    type: str
    title: str
    status: int
    code: str
    detail: str
    instance: str | None = None
