"""The shared-lock decider: read/write locks and semaphores, one aggregate for both.

A shared lock is a lock of its own, on the stream ``shared/<resource>`` ("/" is never in a resource, so it
never collides with the mutex of the same name, nor with a saga). It has any number of *grants*, each with
its own fencing token (the stream version of its ``SHARED_ACQUIRED``), owner, TTL and deadline, and a
``mode``: ``exclusive`` is granted only when no grant is live, ``shared`` only when no exclusive grant is
live and, if the lock has a ``limit``, fewer than ``limit`` grants are. A read/write lock is shared grants
without a limit for readers and an exclusive grant for the writer; a semaphore of N permits is shared
grants with limit N. The limit is agreed, not configured: every acquire names it, and one naming another
limit than the live grants' is refused (``LimitMismatch``) until they are all gone.

Lapsed grants are expired in the decision that needs their place (``SHARED_EXPIRED`` before the grant),
or by the reaper (``ExpireShared``). A grant is decided with its TTL and no deadline: the append stamps it
from the database clock, as for the mutex (``domain/events.py``). Fairness (a writer is never starved by
readers) is the queue's: ``check_queue`` (docs/decisions/0051-shared-locks.md).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from domain.errors import DomainError, InvalidCommand, LeaseExpired, LockHeld, NotHolder, NotOwner
from domain.events import deadline
from domain.queue import Ticket, may_take
from domain.resource import TtlBounds, is_valid_owner, is_valid_resource
from domain.state import is_expired
from domain.timestamps import format_timestamp
from domain.value import value

Mode = Literal["shared", "exclusive"]
SHARED: Mode = "shared"
EXCLUSIVE: Mode = "exclusive"
MODES: tuple[Mode, ...] = (SHARED, EXCLUSIVE)
MAX_LIMIT = 10_000

STREAM_PREFIX = "shared/"  # "/" is never in a resource: no mutex or saga can share a shared lock's stream

SHARED_ACQUIRED = "SHARED_ACQUIRED"
SHARED_RENEWED = "SHARED_RENEWED"
SHARED_RELEASED = "SHARED_RELEASED"
SHARED_EXPIRED = "SHARED_EXPIRED"
SHARED_EVENT_TYPES = frozenset({SHARED_ACQUIRED, SHARED_RENEWED, SHARED_RELEASED, SHARED_EXPIRED})
SHARED_GRANTS = frozenset({SHARED_ACQUIRED, SHARED_RENEWED})  # the events that set a grant's deadline


def stream_id(resource: str) -> str:
    """The log's stream of the shared lock on ``resource``."""
    return STREAM_PREFIX + resource


# --- commands ------------------------------------------------------------------------------------------


@value
class AcquireShared:
    """A grant in ``mode`` for ``ttl_ms``; ``limit``: the most grants the lock may have (None: no limit).
    ``wait_ms``: how long the service may wait for a place; the decision never waits."""

    resource: str
    owner: str
    mode: Mode
    ttl_ms: int
    limit: int | None = None
    wait_ms: int = 0


@value
class RenewShared:
    """The grant's heartbeat. ``ttl_ms=None`` keeps the TTL the grant was given."""

    resource: str
    owner: str
    fencing_token: int
    ttl_ms: int | None = None


@value
class ReleaseShared:
    resource: str
    owner: str
    fencing_token: int


@value
class ExpireShared:
    """Issued by the reaper: expire every grant whose deadline has passed."""

    resource: str


SharedCommand = AcquireShared | RenewShared | ReleaseShared | ExpireShared


# --- events --------------------------------------------------------------------------------------------


@value
class SharedAcquired:
    resource: str
    owner: str
    mode: Mode
    limit: int | None
    fencing_token: int
    ttl_ms: int
    expires_at: datetime | None  # None until the append stamps it
    type: str = SHARED_ACQUIRED


@value
class SharedRenewed:
    resource: str
    owner: str
    fencing_token: int
    ttl_ms: int
    expires_at: datetime | None  # None until the append stamps it
    type: str = SHARED_RENEWED


@value
class SharedReleased:
    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    type: str = SHARED_RELEASED


@value
class SharedExpired:
    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime
    type: str = SHARED_EXPIRED


SharedEvent = SharedAcquired | SharedRenewed | SharedReleased | SharedExpired


# --- state ---------------------------------------------------------------------------------------------


@value
class Grant:
    """One holder of a shared lock. A grant whose deadline has passed is lapsed: no longer live, though
    its ``SHARED_EXPIRED`` may not be appended yet."""

    owner: str
    mode: Mode
    limit: int | None
    fencing_token: int
    ttl_ms: int
    expires_at: datetime

    def is_live(self, now: datetime) -> bool:
        return not is_expired(self.expires_at, now)


@value
class SharedLockState:
    """``version``: the stream version of the last event (0 for a lock never taken); ``grants``: the grants
    not yet released or expired, in token order."""

    resource: str
    version: int = 0
    grants: tuple[Grant, ...] = ()

    def live(self, now: datetime) -> tuple[Grant, ...]:
        return tuple(grant for grant in self.grants if grant.is_live(now))

    def lapsed(self, now: datetime) -> tuple[Grant, ...]:
        return tuple(grant for grant in self.grants if not grant.is_live(now))

    def limit(self, now: datetime) -> int | None:
        """The limit the live grants agreed on (None: none, or no live grant)."""
        live = self.live(now)
        return live[0].limit if live else None


def initial_state(resource: str) -> SharedLockState:
    return SharedLockState(resource)


# --- refusals ------------------------------------------------------------------------------------------


class SharedLockHeld(LockHeld):
    """The grant asked for conflicts with live grants (``conflicts``). ``LockHeld``'s fields name the one
    that ends first, whose deadline is when the refusal may be overturned by the clock alone."""

    def __init__(self, resource: str, conflicts: tuple[Grant, ...], now: datetime, reason: str) -> None:
        first = min(conflicts, key=lambda grant: grant.expires_at)
        holders = ", ".join(
            f"{grant.owner} ({grant.mode}, token {grant.fencing_token},"
            f" until {format_timestamp(grant.expires_at)})"
            for grant in conflicts
        )
        super().__init__(
            resource, first.owner, first.expires_at, first.fencing_token,
            (first.expires_at - now).total_seconds(), f"{resource} {reason}: {holders}",
        )  # fmt: skip
        self.conflicts = conflicts


class LimitMismatch(DomainError):
    """The acquire names another limit than the live grants agreed on."""

    code = "limit_mismatch"

    def __init__(self, resource: str, limit: int | None, asked: int | None) -> None:
        super().__init__(
            resource,
            f"{resource} is held with limit {_limit_text(limit)}, not {_limit_text(asked)};"
            " every holder must name the same limit",
        )
        self.limit = limit
        self.asked = asked


def _limit_text(limit: int | None) -> str:
    return "none" if limit is None else str(limit)


# --- decide / evolve -----------------------------------------------------------------------------------

DEFAULT_BOUNDS = TtlBounds()


def decide(
    state: SharedLockState, command: SharedCommand, now: datetime, bounds: TtlBounds = DEFAULT_BOUNDS
) -> list[SharedEvent]:
    """The events ``command`` causes on the shared lock in ``state`` at ``now``; raises a ``DomainError``
    when it is not allowed. An empty list: allowed, nothing changes (expiring when nothing lapsed)."""
    _validate(state, command, bounds)
    if isinstance(command, AcquireShared):
        return _acquire(state, command, now)
    if isinstance(command, ExpireShared):
        return _expiries(state, now)
    grant = _held(state, command.owner, command.fencing_token, now)
    if isinstance(command, RenewShared):
        ttl_ms = command.ttl_ms if command.ttl_ms is not None else grant.ttl_ms
        return [SharedRenewed(state.resource, grant.owner, grant.fencing_token, ttl_ms, None)]
    return [SharedReleased(state.resource, grant.owner, grant.fencing_token, grant.expires_at)]


def conflicts(state: SharedLockState, mode: Mode, limit: int | None, now: datetime) -> tuple[Grant, ...]:
    """The live grants that keep a grant in ``mode`` from being made now (none: it may be). Raises
    ``LimitMismatch`` when live grants agreed on another limit."""
    live = state.live(now)
    if live and live[0].limit != limit:
        raise LimitMismatch(state.resource, live[0].limit, limit)
    if mode == EXCLUSIVE:
        return live
    exclusive = tuple(grant for grant in live if grant.mode == EXCLUSIVE)
    if exclusive:
        return exclusive
    if limit is not None and len(live) >= limit:
        return live
    return ()


def _acquire(state: SharedLockState, command: AcquireShared, now: datetime) -> list[SharedEvent]:
    held = conflicts(state, command.mode, command.limit, now)
    if held:
        reason = "is held" if command.mode == EXCLUSIVE else "has no place for a shared grant"
        raise SharedLockHeld(state.resource, held, now, reason)
    events: list[SharedEvent] = list(_expiries(state, now))
    # The token is the stream version of the SHARED_ACQUIRED event: strictly increasing per resource
    # whatever the mode, and assigned by the same expected-version check that serializes the decision.
    token = state.version + len(events) + 1
    events.append(
        SharedAcquired(
            state.resource, command.owner, command.mode, command.limit, token, command.ttl_ms, None
        )
    )
    return events


def _expiries(state: SharedLockState, now: datetime) -> list[SharedEvent]:
    return [
        SharedExpired(state.resource, grant.owner, grant.fencing_token, grant.expires_at)
        for grant in state.lapsed(now)
    ]


def _held(state: SharedLockState, owner: str, token: int, now: datetime) -> Grant:
    """The live grant ``token`` of ``owner``: renew and release need it."""
    grant = next((grant for grant in state.grants if grant.fencing_token == token), None)
    if grant is None:
        raise NotHolder(
            state.resource,
            f"{owner} holds no grant of {state.resource} with token {token} (ended, or never granted)",
        )
    if grant.owner != owner:
        raise NotOwner(state.resource, owner, grant.owner)
    if not grant.is_live(now):
        raise LeaseExpired(state.resource, grant.expires_at)
    return grant


def evolve(state: SharedLockState, event: SharedEvent) -> SharedLockState:
    """The state after ``event`` (a grant's event must carry its stamped deadline)."""
    version = state.version + 1
    if isinstance(event, SharedAcquired):
        assert event.expires_at is not None
        grant = Grant(
            event.owner, event.mode, event.limit, event.fencing_token, event.ttl_ms, event.expires_at
        )
        return SharedLockState(state.resource, version, (*state.grants, grant))
    if isinstance(event, SharedRenewed):
        assert event.expires_at is not None
        expires_at = event.expires_at
        grants = tuple(
            Grant(g.owner, g.mode, g.limit, g.fencing_token, event.ttl_ms, expires_at)
            if g.fencing_token == event.fencing_token
            else g
            for g in state.grants
        )
        return SharedLockState(state.resource, version, grants)
    grants = tuple(g for g in state.grants if g.fencing_token != event.fencing_token)
    return SharedLockState(state.resource, version, grants)


def fold(state: SharedLockState, events: list[SharedEvent]) -> SharedLockState:
    for event in events:
        state = evolve(state, event)
    return state


def stamp(events: list[SharedEvent], at: datetime) -> list[SharedEvent]:
    """``events`` as appended at ``at``: a grant's deadline is ``at`` plus its TTL (``domain.events.stamp``
    for shared locks; the store writes the same sum in SQL)."""
    stamped: list[SharedEvent] = []
    for event in events:
        if isinstance(event, SharedAcquired):
            event = SharedAcquired(
                event.resource, event.owner, event.mode, event.limit, event.fencing_token, event.ttl_ms,
                deadline(at, event.ttl_ms),
            )  # fmt: skip
        elif isinstance(event, SharedRenewed):
            event = SharedRenewed(
                event.resource, event.owner, event.fencing_token, event.ttl_ms, deadline(at, event.ttl_ms)
            )
        stamped.append(event)
    return stamped


# --- payloads ------------------------------------------------------------------------------------------


def shared_event_payload(event: SharedEvent) -> dict[str, Any]:
    """The JSON body stored in the log (a grant's deadline only once stamped: the append writes it)."""
    payload: dict[str, Any] = {"owner": event.owner, "fencing_token": event.fencing_token}
    if event.expires_at is not None:
        payload["expires_at"] = format_timestamp(event.expires_at)
    if isinstance(event, SharedAcquired):
        payload["mode"] = event.mode
        payload["limit"] = event.limit
    if isinstance(event, SharedAcquired | SharedRenewed):
        payload["ttl_ms"] = event.ttl_ms
    return payload


def shared_event_from_payload(resource: str, event_type: str, data: dict[str, Any]) -> SharedEvent:
    """Inverse of :func:`shared_event_payload`."""
    owner, token = str(data["owner"]), int(data["fencing_token"])
    expires_at = datetime.fromisoformat(str(data["expires_at"]))
    if event_type == SHARED_ACQUIRED:
        limit = data.get("limit")
        mode: Mode = EXCLUSIVE if data["mode"] == EXCLUSIVE else SHARED
        return SharedAcquired(
            resource, owner, mode, None if limit is None else int(limit), token, int(data["ttl_ms"]),
            expires_at,
        )  # fmt: skip
    if event_type == SHARED_RENEWED:
        return SharedRenewed(resource, owner, token, int(data["ttl_ms"]), expires_at)
    if event_type == SHARED_RELEASED:
        return SharedReleased(resource, owner, token, expires_at)
    if event_type == SHARED_EXPIRED:
        return SharedExpired(resource, owner, token, expires_at)
    raise ValueError(f"unknown shared lock event type {event_type!r}")


# --- validation ----------------------------------------------------------------------------------------


def _validate(state: SharedLockState, command: SharedCommand, bounds: TtlBounds) -> None:
    resource = command.resource
    if resource != state.resource:
        raise InvalidCommand(resource, f"command for {resource} applied to {state.resource}")
    if not is_valid_resource(resource):
        raise InvalidCommand(resource, "resource must be 1-200 characters of [A-Za-z0-9._:-], not only dots")
    if isinstance(command, ExpireShared):
        return
    if not is_valid_owner(command.owner):
        raise InvalidCommand(resource, "owner must be 1-200 characters of [A-Za-z0-9._:@-]")
    if isinstance(command, AcquireShared):
        if command.mode not in MODES:
            raise InvalidCommand(resource, f"mode must be shared or exclusive, not {command.mode!r}")
        if command.limit is not None and not 1 <= command.limit <= MAX_LIMIT:
            raise InvalidCommand(resource, f"limit must be between 1 and {MAX_LIMIT}, got {command.limit}")
    ttl_ms = getattr(command, "ttl_ms", None)
    if ttl_ms is not None and not bounds.contains(ttl_ms):
        raise InvalidCommand(
            resource, f"ttl_ms must be between {bounds.min_ms} and {bounds.max_ms}, got {ttl_ms}"
        )


# --- the queue's rule ----------------------------------------------------------------------------------


class SharedQueueAhead(LockHeld):
    """The grant could be made, but an acquire that came first and waits has the prior claim: ``holder``
    and ``expires_at`` name that waiter and its ticket's deadline."""

    def __init__(self, resource: str, ahead: Ticket, now: datetime) -> None:
        detail = (
            f"{resource} is promised to {ahead.owner}, waiting for it since before this acquire"
            f" (until {format_timestamp(ahead.deadline)} at the latest)"
        )
        super().__init__(
            resource, ahead.owner, ahead.deadline, 0, (ahead.deadline - now).total_seconds(), detail
        )
        self.ahead = ahead


def check_queue(
    command: AcquireShared,
    first: Ticket | None,
    first_exclusive: Ticket | None,
    ticket: int | None,
    now: datetime,
) -> None:
    """Refuse (``SharedQueueAhead``) an acquire the decider would grant when a waiter that came first has
    the prior claim. ``first`` is the queue's first live ticket, ``first_exclusive`` its first live ticket
    for an exclusive grant, ``ticket`` the acquire's own (None: it has none, every ticket precedes it).
    An exclusive grant, or a shared one under a limit, waits for every ticket ahead; a shared grant without
    a limit (a reader) only for exclusive ones ahead: readers arriving behind a waiting writer wait
    behind it (the writer is not starved), and readers waiting together are granted together."""
    ahead = first_exclusive if command.mode == SHARED and command.limit is None else first
    if ahead is not None and not may_take(ahead, ticket, now):
        raise SharedQueueAhead(command.resource, ahead, now)
