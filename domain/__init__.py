"""The pure core of lockledger: lock commands, events, state and the decider. No I/O, no frameworks."""

from domain.commands import Accept, Acquire, Command, Decline, Expire, ForceRelease, HandOff, Release, Renew
from domain.decider import decide, evolve, fold
from domain.errors import DomainError, InvalidCommand, LeaseExpired, LockHeld, NotHolder
from domain.events import (
    Event,
    LockAcquired,
    LockExpired,
    LockForceReleased,
    LockHandedOff,
    LockReleased,
    LockRenewed,
    event_from_payload,
    event_payload,
)
from domain.resource import TtlBounds, is_valid_owner, is_valid_resource
from domain.state import LockState, initial_state

__all__ = [
    "Accept",
    "Acquire",
    "Command",
    "Decline",
    "DomainError",
    "Event",
    "Expire",
    "ForceRelease",
    "HandOff",
    "InvalidCommand",
    "LeaseExpired",
    "LockAcquired",
    "LockExpired",
    "LockForceReleased",
    "LockHandedOff",
    "LockHeld",
    "LockReleased",
    "LockRenewed",
    "LockState",
    "NotHolder",
    "Release",
    "Renew",
    "TtlBounds",
    "decide",
    "event_from_payload",
    "event_payload",
    "evolve",
    "fold",
    "initial_state",
    "is_valid_owner",
    "is_valid_resource",
]
