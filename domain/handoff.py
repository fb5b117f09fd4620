"""Hand-off of a live lease (docs/decisions/0047-lease-hand-off.md): the decisions of ``HandOff``,
``Accept`` and ``Decline``, which ``domain.decider.decide`` dispatches here.

- ``HandOff``: the holder, with its token and while its lease is live, names the receiver. One event,
  ``LOCK_HANDED_OFF``, ends the giver's lease and begins the receiver's with the next fencing token (the
  event's stream version, as for an acquire) and a deadline ``accept_within_ms`` away.
- ``Accept``: the receiver, before that deadline, renews the lease for its own TTL and so learns the
  token. Only a hand-off not yet accepted can be accepted, so the token is handed out once.
- ``Decline``: the receiver ends the lease it was handed (``LOCK_RELEASED``) instead of letting it lapse.
"""

from __future__ import annotations

from datetime import datetime

from domain.commands import Accept, Decline, HandOff
from domain.errors import InvalidCommand, LeaseExpired, NotHolder
from domain.events import Event, LockHandedOff, LockReleased, LockRenewed
from domain.resource import TtlBounds, is_valid_owner
from domain.state import LockState


def hand_off(state: LockState, command: HandOff) -> list[Event]:
    """The hand-off's event, once ``_check_holder`` has found the giver holds the live lease."""
    assert state.owner is not None
    return [
        LockHandedOff(
            state.resource, command.to, state.version + 1, command.accept_within_ms, None,
            state.owner, state.fencing_token,
        )
    ]  # fmt: skip


def validate_hand_off(command: HandOff, bounds: TtlBounds) -> None:
    """The hand-off's own fields: a receiver that is a valid owner other than the giver, and a time to
    accept within the TTL bounds (a handed-off lease is a lease of that length until accepted)."""
    if not is_valid_owner(command.to):
        raise InvalidCommand(command.resource, "to must be 1-200 characters of [A-Za-z0-9._:@-]")
    if command.to == command.owner:
        raise InvalidCommand(command.resource, f"{command.owner} cannot hand {command.resource} to itself")
    if not bounds.contains(command.accept_within_ms):
        raise InvalidCommand(
            command.resource,
            f"accept_within_ms must be between {bounds.min_ms} and {bounds.max_ms},"
            f" got {command.accept_within_ms}",
        )


def take_up(state: LockState, command: Accept | Decline, now: datetime) -> list[Event]:
    """Accept or decline the hand-off awaiting ``command.owner``: allowed only while the lease handed to
    it is live and not yet taken up; 410 ``lease_expired`` once its deadline passed unaccepted."""
    awaiting = state.handed_off_by is not None and state.owner == command.owner and state.status == "held"
    if not awaiting:
        raise NotHolder(
            state.resource, f"no hand-off of {state.resource} to {command.owner} awaits acceptance"
        )
    assert state.expires_at is not None
    assert state.ttl_ms is not None
    if state.is_lapsed(now):
        raise LeaseExpired(state.resource, state.expires_at)
    if isinstance(command, Accept):
        return [LockRenewed(state.resource, command.owner, state.fencing_token, command.ttl_ms, None)]
    return [LockReleased(state.resource, command.owner, state.fencing_token, state.expires_at)]
