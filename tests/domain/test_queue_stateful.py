"""Stateful property test of the fair queue's rule (``domain/queue.py``) against a simple model.

Agents join one lock's queue (a ticket each, numbered in arrival order, live for its wait), leave it,
die (their ticket stays until its deadline), and try to take the lock with or without a ticket, while
the holder releases or hands the lease on (whoever queues) and a simulated database clock moves on.
The machine decides each try with ``check_turn`` and the lock decider; the model, without either and
without their state (it keeps its own holder, token and deadline), says a free lock goes to a ticket
holder only if no live ticket precedes it, and never to an acquire without a ticket while any ticket
lives, that a refusal names the first live ticket, and which token a grant gets. After every step: the
decider's state agreed with the model, tokens strictly increasing, and the tickets granted came in
arrival order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from domain.commands import Acquire, HandOff, Release
from domain.decider import decide, fold
from domain.errors import LockHeld
from domain.events import stamp
from domain.queue import QueueAhead, Ticket, check_turn, first_live
from domain.resource import TtlBounds
from domain.state import LockState, initial_state

RESOURCE = "zone:A1"
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)


@dataclass
class Holder:
    """The lock as the model sees it: who holds it, with which token, until when."""

    owner: str
    token: int
    deadline: datetime


class FairQueue(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.state: LockState = initial_state(RESOURCE)
        self.tickets: list[Ticket] = []  # what the store keeps
        self.dead: set[int] = set()  # tickets whose waiter died: never tries, never leaves
        self.numbers = itertools.count(1)
        self.granted_tickets: list[int] = []
        self.tokens: list[int] = []
        self.holder: Holder | None = None  # the model's lock, kept without the decider's state
        self.events = 0  # the model's count of the stream's events

    def _live(self) -> list[Ticket]:
        return [t for t in self.tickets if t.deadline > self.now]

    def _model_free(self) -> bool:
        return self.holder is None or self.holder.deadline <= self.now

    def _model_head(self) -> Ticket | None:
        live = self._live()
        return min(live, key=lambda t: t.ticket) if live else None

    def _try(self, owner: str, ticket: int | None) -> None:
        head = first_live(self.tickets, self.now)  # as the store reads it
        ahead = [t for t in self._live() if ticket is None or t.ticket < ticket]
        model_grants = self._model_free() and not ahead
        named: Ticket | None = None
        try:
            check_turn(self.state, head, ticket, self.now)
            events = decide(self.state, Acquire(RESOURCE, owner, 1_000), self.now, BOUNDS)
        except QueueAhead as refused:
            named = refused.head
        except LockHeld:
            assert not model_grants
            assert not self._model_free()
            return
        if named is not None:
            assert not model_grants
            assert self._model_free()
            assert named == self._model_head()
            return
        assert model_grants, (owner, ticket, self.tickets)
        self.state = fold(self.state, stamp(events, self.now))
        lapsed = self.holder is not None  # free by the model, yet still recorded as held: expired first
        self.events += 2 if lapsed else 1
        assert self.state.fencing_token == self.events
        self.holder = Holder(owner, self.events, self.now + timedelta(milliseconds=1_000))
        self.tokens.append(self.state.fencing_token)
        if ticket is not None:
            self.tickets = [t for t in self.tickets if t.ticket != ticket]
            self.granted_tickets.append(ticket)

    @rule(wait_ms=st.integers(min_value=1, max_value=3_000))
    def join(self, wait_ms: int) -> None:
        number = next(self.numbers)
        self.tickets.append(Ticket(number, f"agv-{number}", self.now + timedelta(milliseconds=wait_ms)))

    @rule(data=st.data())
    def waiter_tries(self, data: st.DataObject) -> None:
        trying = [t for t in self._live() if t.ticket not in self.dead]
        if trying:
            ticket = data.draw(st.sampled_from(trying))
            self._try(ticket.owner, ticket.ticket)

    @rule()
    def newcomer_tries(self) -> None:
        self._try("newcomer", None)

    @rule(data=st.data())
    def waiter_leaves(self, data: st.DataObject) -> None:
        leaving = [t for t in self.tickets if t.ticket not in self.dead]
        if leaving:
            gone = data.draw(st.sampled_from(leaving))
            self.tickets.remove(gone)

    @rule(data=st.data())
    def waiter_dies(self, data: st.DataObject) -> None:
        alive = [t for t in self.tickets if t.ticket not in self.dead]
        if alive:
            self.dead.add(data.draw(st.sampled_from(alive)).ticket)

    @rule()
    def holder_releases(self) -> None:
        if self.holder is not None and not self._model_free():
            release = Release(RESOURCE, self.holder.owner, self.holder.token)
            self.state = fold(self.state, decide(self.state, release, self.now, BOUNDS))
            self.events += 1
            self.holder = None

    @rule(to=st.sampled_from(["picker-1", "picker-2"]))
    def holder_hands_off(self, to: str) -> None:
        """A hand-off passes the held lease on whoever queues: it is not a taking of a free lock, so the
        queue's turn comes when the receiver lets go (docs/decisions/0049)."""
        if self.holder is not None and not self._model_free() and self.holder.owner != to:
            hand_off = HandOff(RESOURCE, self.holder.owner, self.holder.token, to, 1_000)
            self.state = fold(self.state, stamp(decide(self.state, hand_off, self.now, BOUNDS), self.now))
            self.events += 1
            self.holder = Holder(to, self.events, self.now + timedelta(milliseconds=1_000))
            self.tokens.append(self.state.fencing_token)

    @rule(ms=st.integers(min_value=1, max_value=2_000))
    def time_passes(self, ms: int) -> None:
        self.now += timedelta(milliseconds=ms)

    @invariant()
    def the_decider_agrees_with_the_model(self) -> None:
        assert self.state.version == self.events
        assert self.state.is_live(self.now) == (not self._model_free())
        if self.holder is not None and not self._model_free():
            assert (self.state.owner, self.state.fencing_token) == (self.holder.owner, self.holder.token)

    @invariant()
    def tokens_strictly_increase(self) -> None:
        assert self.tokens == sorted(set(self.tokens))

    @invariant()
    def tickets_granted_in_arrival_order(self) -> None:
        assert self.granted_tickets == sorted(self.granted_tickets)


FairQueue.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestFairQueue = FairQueue.TestCase
