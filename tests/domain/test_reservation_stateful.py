"""Stateful property test of the reservation decider against an independent model.

Owners reserve, renew and release sets of three resources (and take single locks in between) while a
simulated database clock moves on. The machine folds the decider's events into each lock's state and
keeps, without ``evolve`` or the lock decider, a model of each resource: who holds it, with which token,
until when. After every step it checks that the decider agreed with the model (granted exactly when the
model says every resource is free, refused naming exactly the held ones, all or nothing), and the
safety properties: at most one live holder per resource, tokens strictly increasing per resource.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from domain.commands import Acquire
from domain.decider import decide, fold
from domain.errors import DomainError, InvalidCommand, LeaseExpired, LockHeld, NotHolder
from domain.events import Event, LockAcquired, LockRenewed, stamp
from domain.reservation import (
    ReleaseReservation,
    RenewReservation,
    ReservationHeld,
    Reserve,
    ReservedLease,
    decide_reservation,
)
from domain.state import LockState, initial_state

RESOURCES = ("zone:A1", "zone:A2", "zone:A3")
OWNERS = ("agv-1", "agv-2")
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)

subsets = st.lists(st.sampled_from(RESOURCES), min_size=1, max_size=3, unique=True)
owners = st.sampled_from(OWNERS)
ttls = st.integers(min_value=1_000, max_value=10_000)


@dataclass
class Model:
    """One resource as the model sees it: the last grant's holder, token and deadline, and whether it
    ended (released) before its deadline; ``grants`` counts the grants, ``events`` the stream's events."""

    holder: str | None = None
    token: int = 0
    expires_at: datetime | None = None
    ended: bool = False
    events: int = 0

    def live(self, now: datetime) -> bool:
        return (
            self.holder is not None
            and not self.ended
            and self.expires_at is not None
            and now < self.expires_at
        )

    def lapsed_unrecorded(self, now: datetime) -> bool:
        """Held by the log's last event, but past its deadline: an acquire appends the expiry first."""
        return (
            self.holder is not None
            and not self.ended
            and self.expires_at is not None
            and now >= self.expires_at
        )


class ReservationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.states: dict[str, LockState] = {r: initial_state(r) for r in RESOURCES}
        self.model: dict[str, Model] = {r: Model() for r in RESOURCES}
        self.granted_tokens: dict[str, list[int]] = {r: [] for r in RESOURCES}
        self.sets: dict[str, dict[str, int]] = {}  # reservation id -> the leases its holder believes held
        self.owner_of: dict[str, str] = {}
        self.counter = 0

    # --- applying a decision ----------------------------------------------------------------------

    def _append(self, decided: dict[str, list[Event]]) -> None:
        for resource, events in decided.items():
            stamped = stamp(events, self.now)
            self.states[resource] = fold(self.states[resource], stamped)
            for event in stamped:
                if isinstance(event, LockAcquired):
                    self.granted_tokens[resource].append(event.fencing_token)

    # --- rules ------------------------------------------------------------------------------------

    @rule(millis=st.integers(min_value=0, max_value=12_000))
    def time_passes(self, millis: int) -> None:
        self.now += timedelta(milliseconds=millis)

    @rule(resources=subsets, owner=owners, ttl=ttls)
    def reserve(self, resources: list[str], owner: str, ttl: int) -> None:
        self.counter += 1
        rid = f"r{self.counter}"
        command = Reserve(rid, tuple(resources), owner, ttl)
        held = sorted(r for r in resources if self.model[r].live(self.now))
        before = dict(self.states)
        refusal: ReservationHeld | None = None
        try:
            decided = decide_reservation(self.states, command, self.now)
        except ReservationHeld as error:
            refusal = error
        if refusal is not None:
            assert held, "refused a set the model says is free"
            assert [c.resource for c in refusal.conflicts] == held
            assert [c.holder for c in refusal.conflicts] == [self.model[r].holder for r in held]
            assert self.states == before
            return
        assert not held, f"granted {resources} while the model says {held} are held"
        assert sorted(decided) == sorted(resources)
        for resource in resources:
            m = self.model[resource]
            expected = m.events + (2 if m.lapsed_unrecorded(self.now) else 1)
            assert decided[resource][-1].fencing_token == expected
            m.events = expected
            m.holder, m.token, m.ended = owner, expected, False
            m.expires_at = self.now + timedelta(milliseconds=ttl)
        self._append(decided)
        self.sets[rid] = {r: self.model[r].token for r in resources}
        self.owner_of[rid] = owner

    @rule(data=st.data(), ttl=st.none() | ttls)
    def renew_a_set(self, data: st.DataObject, ttl: int | None) -> None:
        if not self.sets:
            return
        rid = data.draw(st.sampled_from(sorted(self.sets)))
        leases = self.sets[rid]
        if not leases:
            return
        owner = self.owner_of[rid]
        command = RenewReservation(rid, owner, tuple(ReservedLease(r, t) for r, t in leases.items()), ttl)
        ok = all(self._holds(owner, r, t) for r, t in leases.items())
        before = dict(self.states)
        try:
            decided = decide_reservation(self.states, command, self.now)
        except (NotHolder, LeaseExpired):
            assert not ok, "refused a renewal of leases the model says are live"
            assert self.states == before
            return
        assert ok, "renewed a set the model says is not all live"
        deadlines = set()
        for resource, events in decided.items():
            [event] = events
            assert isinstance(event, LockRenewed)
            assert event.fencing_token == leases[resource]  # a renewal keeps the token
            m = self.model[resource]
            m.events += 1
            m.expires_at = self.now + timedelta(milliseconds=event.ttl_ms)
            deadlines.add(m.expires_at)
        assert len(deadlines) == 1  # one deadline for the set
        self._append(decided)

    @rule(data=st.data())
    def release_part_of_a_set(self, data: st.DataObject) -> None:
        if not self.sets:
            return
        rid = data.draw(st.sampled_from(sorted(self.sets)))
        leases = self.sets[rid]
        if not leases:
            return
        part = data.draw(st.lists(st.sampled_from(sorted(leases)), min_size=1, unique=True))
        owner = self.owner_of[rid]
        command = ReleaseReservation(rid, owner, tuple(ReservedLease(r, leases[r]) for r in part))
        ok = all(self._holds(owner, r, leases[r]) for r in part)
        before = dict(self.states)
        try:
            decided = decide_reservation(self.states, command, self.now)
        except (NotHolder, LeaseExpired):
            assert not ok
            assert self.states == before
            return
        assert ok
        for resource in part:
            self.model[resource].events += 1
            self.model[resource].ended = True
            del leases[resource]
        self._append(decided)

    @rule(resource=st.sampled_from(RESOURCES), owner=owners, ttl=ttls)
    def a_single_acquire(self, resource: str, owner: str, ttl: int) -> None:
        """Another agent takes one lock outside any reservation (the mutex the reservation shares)."""
        try:
            events = decide(self.states[resource], Acquire(resource, owner, ttl), self.now)
        except LockHeld:
            assert self.model[resource].live(self.now)
            return
        m = self.model[resource]
        m.events += len(events)
        m.holder, m.token, m.ended = owner, m.events, False
        m.expires_at = self.now + timedelta(milliseconds=ttl)
        self._append({resource: events})

    @rule(resources=st.lists(st.sampled_from(RESOURCES), min_size=2, max_size=4), owner=owners)
    def a_resource_named_twice_is_invalid(self, resources: list[str], owner: str) -> None:
        if len(set(resources)) == len(resources):
            return
        before = dict(self.states)
        try:
            decide_reservation(self.states, Reserve("dup", tuple(resources), owner, 5_000), self.now)
        except InvalidCommand:
            assert self.states == before
            return
        raise AssertionError("a reservation naming a resource twice was decided")

    def _holds(self, owner: str, resource: str, token: int) -> bool:
        m = self.model[resource]
        return m.holder == owner and m.token == token and m.live(self.now)

    # --- invariants -------------------------------------------------------------------------------

    @invariant()
    def the_decider_agrees_with_the_model(self) -> None:
        for resource in RESOURCES:
            state, m = self.states[resource], self.model[resource]
            assert state.version == m.events
            assert state.is_live(self.now) == m.live(self.now)
            if m.live(self.now):
                assert (state.owner, state.fencing_token, state.expires_at) == (
                    m.holder,
                    m.token,
                    m.expires_at,
                )

    @invariant()
    def tokens_strictly_increase_per_resource(self) -> None:
        for tokens in self.granted_tokens.values():
            assert all(a < b for a, b in itertools.pairwise(tokens))


ReservationMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestReservationDecider = ReservationMachine.TestCase


def test_domain_errors_other_than_held_are_the_first_resources() -> None:
    """A renewal refused on two resources names the first in lock order, as one lock's refusal."""
    states = {r: initial_state(r) for r in RESOURCES}
    leases = (ReservedLease("zone:A3", 1), ReservedLease("zone:A2", 1))
    with pytest.raises(DomainError) as refused:
        decide_reservation(states, RenewReservation("r", "agv-1", leases), T0)
    assert refused.value.resource == "zone:A2"
