"""The lock decider: ``decide(state, command, now) -> events`` and ``evolve(state, event) -> state``.

Pure functions over plain data. ``now`` is the clock the decision is checked against (a lease live or
lapsed). A grant is decided with its TTL and no deadline: the append stamps it from the clock read where
the decision is serialized (``domain.events.stamp``), and re-checks a renewed or released lease there.
"""

from __future__ import annotations

from datetime import datetime

from domain.commands import Accept, Acquire, Command, Decline, Expire, ForceRelease, HandOff, Release, Renew
from domain.errors import InvalidCommand, LeaseExpired, LockHeld, NotHolder, NotOwner
from domain.events import (
    LOCK_EXPIRED,
    Event,
    LockAcquired,
    LockExpired,
    LockForceReleased,
    LockHandedOff,
    LockReleased,
    LockRenewed,
)
from domain.handoff import hand_off, take_up, validate_hand_off
from domain.resource import TtlBounds, is_valid_owner, is_valid_resource
from domain.state import LockState

DEFAULT_BOUNDS = TtlBounds()


def decide(
    state: LockState, command: Command, now: datetime, bounds: TtlBounds = DEFAULT_BOUNDS
) -> list[Event]:
    """The events that ``command`` causes on a lock in ``state`` at instant ``now``.

    Raises a :class:`~domain.errors.DomainError` when the command is not allowed. An empty list means
    the command is allowed but changes nothing (expiring a lease that is still live, force-releasing a
    free lock).
    """
    _validate(state, command, bounds)
    if isinstance(command, Acquire):
        return _acquire(state, command, now)
    if isinstance(command, Renew):
        _check_holder(state, command.owner, command.fencing_token, now)
        ttl_ms = command.ttl_ms if command.ttl_ms is not None else (state.ttl_ms or bounds.default_ms)
        return [LockRenewed(state.resource, command.owner, state.fencing_token, ttl_ms, None)]
    if isinstance(command, Release):
        _check_holder(state, command.owner, command.fencing_token, now)
        assert state.expires_at is not None
        return [LockReleased(state.resource, command.owner, state.fencing_token, state.expires_at)]
    if isinstance(command, Expire):
        return [_expiry(state)] if state.is_lapsed(now) else []
    if isinstance(command, HandOff):
        _check_holder(state, command.owner, command.fencing_token, now)
        return hand_off(state, command)
    if isinstance(command, Accept | Decline):
        return take_up(state, command, now)
    if isinstance(command, ForceRelease):
        if state.is_lapsed(now):
            return [_expiry(state)]
        if state.is_live(now):
            assert state.owner is not None
            assert state.expires_at is not None
            return [
                LockForceReleased(
                    state.resource, state.owner, state.fencing_token, state.expires_at, command.reason
                )
            ]
        return []
    raise TypeError(f"not a lock command: {command!r}")  # pragma: no cover - exhaustive above


def evolve(state: LockState, event: Event) -> LockState:
    """The state after ``event``; each event carries all it needs, so older events are never consulted."""
    # Built directly rather than with dataclasses.replace, which inspects the fields on every call: this
    # runs on every command.
    if isinstance(event, LockAcquired | LockRenewed | LockHandedOff):
        return LockState(
            resource=state.resource,
            version=state.version + 1,
            status="held",
            owner=event.owner,
            fencing_token=event.fencing_token,
            ttl_ms=event.ttl_ms,
            expires_at=event.expires_at,
            ended_by=None,
            handed_off_by=event.from_owner if isinstance(event, LockHandedOff) else None,
        )
    return LockState(
        resource=state.resource,
        version=state.version + 1,
        status="free",
        owner=event.owner,
        fencing_token=event.fencing_token,
        ttl_ms=state.ttl_ms,
        expires_at=event.expires_at,
        ended_by=event.type,
    )


def fold(state: LockState, events: list[Event]) -> LockState:
    for event in events:
        state = evolve(state, event)
    return state


def _acquire(state: LockState, command: Acquire, now: datetime) -> list[Event]:
    if state.is_live(now):
        assert state.owner is not None
        assert state.expires_at is not None
        due_in_s = (state.expires_at - now).total_seconds()
        raise LockHeld(state.resource, state.owner, state.expires_at, state.fencing_token, due_in_s)
    events: list[Event] = []
    if state.is_lapsed(now):
        events.append(_expiry(state))
    # The token is the stream version of the LOCK_ACQUIRED event: strictly increasing per resource,
    # and assigned by the same expected-version check that serializes the decision.
    token = state.version + len(events) + 1
    events.append(LockAcquired(state.resource, command.owner, token, command.ttl_ms, None))
    return events


def _check_holder(state: LockState, owner: str, token: int, now: datetime) -> None:
    """Renew and release need the current lease's owner and token, and a lease still live."""
    if state.owner is not None and owner != state.owner:
        raise NotOwner(state.resource, owner, state.owner)
    if state.fencing_token == 0 or token != state.fencing_token:
        raise NotHolder(state.resource, f"{owner} does not hold {state.resource} with token {token}")
    if state.is_lapsed(now) or (state.status == "free" and state.ended_by == LOCK_EXPIRED):
        assert state.expires_at is not None
        raise LeaseExpired(state.resource, state.expires_at)
    if state.status != "held":
        raise NotHolder(state.resource, f"the lease on {state.resource} with token {token} has ended")


def _expiry(state: LockState) -> LockExpired:
    assert state.owner is not None
    assert state.expires_at is not None
    return LockExpired(state.resource, state.owner, state.fencing_token, state.expires_at)


def _validate(state: LockState, command: Command, bounds: TtlBounds) -> None:
    if command.resource != state.resource:
        raise InvalidCommand(command.resource, f"command for {command.resource} applied to {state.resource}")
    if not is_valid_resource(command.resource):
        raise InvalidCommand(
            command.resource, "resource must be 1-200 characters of [A-Za-z0-9._:-], not only dots"
        )
    owner = getattr(command, "owner", None)
    if owner is not None and not is_valid_owner(owner):
        raise InvalidCommand(command.resource, "owner must be 1-200 characters of [A-Za-z0-9._:@-]")
    reason = getattr(command, "reason", None)
    if reason is not None and (not reason or len(reason) > 1000 or "\x00" in reason):
        raise InvalidCommand(command.resource, "reason must be 1-1000 characters without NUL")
    if isinstance(command, HandOff):
        validate_hand_off(command, bounds)
    ttl_ms = getattr(command, "ttl_ms", None)
    if ttl_ms is not None and not bounds.contains(ttl_ms):
        raise InvalidCommand(
            command.resource, f"ttl_ms must be between {bounds.min_ms} and {bounds.max_ms}, got {ttl_ms}"
        )
