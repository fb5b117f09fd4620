"""The reservation decider: several locks taken, renewed and released as one, all or nothing.

A reservation is not a new kind of lock. It is a set of ordinary leases, one per resource stream, each
with its own fencing token, decided together: ``decide_reservation`` runs the lock decider
(``domain/decider.py``) on every resource and returns the events of every stream, or raises and returns
none. The store appends them in one transaction (``service/reservation_service.py``), so the log holds
the whole set or nothing of it; the events are the lock's own (``LOCK_ACQUIRED``, ``LOCK_RENEWED``,
``LOCK_RELEASED``) with the reservation id in their metadata (docs/decisions/0048-reservations.md).

Resources are decided, and their heads locked, in sorted order, so that two reservations never wait for
each other in the database. A refused reservation holds nothing, so waiting for one (``wait_ms``) holds
no partial set and no deadlock can form between waiting reservations.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime

from domain.commands import Acquire, Release, Renew
from domain.decider import DEFAULT_BOUNDS, decide
from domain.errors import InvalidCommand, LockHeld, NotHolder
from domain.events import Event
from domain.resource import TtlBounds, is_valid_resource
from domain.state import LockState
from domain.timestamps import format_timestamp
from domain.value import value

MAX_RESOURCES = 64  # a route through a site's zones, not a bulk operation
RESERVATION_ID_PATTERN = r"^[A-Za-z0-9._:\-]*[A-Za-z0-9_:\-][A-Za-z0-9._:\-]*$"
RESERVATION_ID_MAX_LENGTH = 100
_ID_RE = re.compile(RESERVATION_ID_PATTERN)


def is_valid_reservation_id(text: str) -> bool:
    """1-100 characters of ``[A-Za-z0-9._:-]``, not only dots (as a resource: one URL path segment)."""
    return len(text) <= RESERVATION_ID_MAX_LENGTH and _ID_RE.match(text) is not None


@value
class ReservedLease:
    """One lease of a reservation: a resource and the fencing token its grant returned."""

    resource: str
    fencing_token: int


@value
class Reserve:
    """Take every resource for ``ttl_ms``, or none. ``wait_ms``: how long the service may wait for the
    whole set to come free; the decision never waits, and nothing is held while the service waits."""

    reservation_id: str
    resources: tuple[str, ...]
    owner: str
    ttl_ms: int
    wait_ms: int = 0


@value
class RenewReservation:
    """The set's heartbeat: every named lease renewed to one deadline, or none. ``ttl_ms=None`` keeps the
    leases' TTL (the longest, should they differ after single renewals)."""

    reservation_id: str
    owner: str
    leases: tuple[ReservedLease, ...]
    ttl_ms: int | None = None


@value
class ReleaseReservation:
    """End every named lease (the whole set, or the one zone a vehicle has left), or none."""

    reservation_id: str
    owner: str
    leases: tuple[ReservedLease, ...]


ReservationCommand = Reserve | RenewReservation | ReleaseReservation


class ReservationHeld(LockHeld):
    """Some resources of a reservation are held. The first (in lock order) fills ``LockHeld``'s fields,
    so whatever handles one held lock handles this; ``conflicts`` names every held resource."""

    def __init__(self, conflicts: tuple[LockHeld, ...]) -> None:
        first = conflicts[0]
        super().__init__(first.resource, first.holder, first.expires_at, first.fencing_token)
        self.conflicts = conflicts
        self.detail = "; ".join(
            f"{held.resource} is held by {held.holder} until {format_timestamp(held.expires_at)}"
            for held in conflicts
        )
        self.args = (self.detail,)


def resources_of(command: ReservationCommand) -> tuple[str, ...]:
    """The resources ``command`` touches, in the order they are decided and locked (sorted)."""
    if isinstance(command, Reserve):
        return tuple(sorted(command.resources))
    return tuple(sorted({lease.resource for lease in command.leases}))


def tokens_of(command: RenewReservation | ReleaseReservation) -> dict[str, int]:
    """The fencing token named for each resource. A lease named twice is named once; a resource named
    with two tokens cannot be held with both: ``NotHolder``, as for a token that is not the current one."""
    tokens: dict[str, int] = {}
    for lease in command.leases:
        if tokens.setdefault(lease.resource, lease.fencing_token) != lease.fencing_token:
            raise NotHolder(lease.resource, f"{lease.resource} is named with two fencing tokens")
    return tokens


def decide_reservation(
    states: Mapping[str, LockState],
    command: ReservationCommand,
    now: datetime,
    bounds: TtlBounds = DEFAULT_BOUNDS,
) -> dict[str, list[Event]]:
    """The events of each resource's stream (in lock order) that ``command`` causes at ``now``, every
    resource's state given in ``states``. All or nothing: a refusal of any resource raises and decides
    nothing. A reserve refused because resources are held raises ``ReservationHeld`` naming every one of
    them; any other refusal is the first resource's (in lock order), as the lock decider words it."""
    validate_reservation(command)
    resources = resources_of(command)
    if isinstance(command, Reserve):
        decided: dict[str, list[Event]] = {}
        held: list[LockHeld] = []
        for resource in resources:
            try:
                decided[resource] = decide(
                    states[resource], Acquire(resource, command.owner, command.ttl_ms), now, bounds
                )
            except LockHeld as error:
                held.append(error)
        if held:
            raise ReservationHeld(tuple(held))
        return decided
    tokens = tokens_of(command)
    if isinstance(command, RenewReservation):
        ttl_ms = command.ttl_ms if command.ttl_ms is not None else _common_ttl(states, resources, bounds)
        return {
            resource: decide(
                states[resource], Renew(resource, command.owner, tokens[resource], ttl_ms), now, bounds
            )
            for resource in resources
        }
    return {
        resource: decide(states[resource], Release(resource, command.owner, tokens[resource]), now, bounds)
        for resource in resources
    }


def _common_ttl(states: Mapping[str, LockState], resources: tuple[str, ...], bounds: TtlBounds) -> int:
    """The one TTL a renewal without one gives the set: the leases' own (the longest if they differ)."""
    ttls = [states[resource].ttl_ms for resource in resources if states[resource].ttl_ms is not None]
    return max((ttl for ttl in ttls if ttl is not None), default=bounds.default_ms)


def validate_reservation(command: ReservationCommand) -> None:
    """Refuse (``InvalidCommand``) a command whose own fields are wrong, whatever the locks' states: a bad
    reservation id, no resource or too many, a bad resource name, a resource reserved twice (a renewal or
    release may name a lease twice: ``tokens_of``)."""
    if isinstance(command, Reserve):
        resources = list(command.resources)
    else:
        resources = list(dict.fromkeys(lease.resource for lease in command.leases))
    subject = resources[0] if resources else command.reservation_id
    if not is_valid_reservation_id(command.reservation_id):
        raise InvalidCommand(
            subject, "reservation_id must be 1-100 characters of [A-Za-z0-9._:-], not only dots"
        )
    if not 1 <= len(resources) <= MAX_RESOURCES:
        raise InvalidCommand(
            subject, f"a reservation names 1 to {MAX_RESOURCES} resources, not {len(resources)}"
        )
    for resource in resources:
        if not is_valid_resource(resource):
            raise InvalidCommand(
                resource, "resource must be 1-200 characters of [A-Za-z0-9._:-], not only dots"
            )
    if len(set(resources)) != len(resources):
        duplicates = sorted({resource for resource in resources if resources.count(resource) > 1})
        raise InvalidCommand(
            duplicates[0], f"a reservation names each resource once: {', '.join(duplicates)}"
        )
