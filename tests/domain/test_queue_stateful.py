"""Stateful property test of the fair queue's rule (``domain/queue.py``) against a simple model.

Agents join one lock's queue (a ticket each, numbered in arrival order, live for its wait), leave it,
die (their ticket stays until its deadline), and try to take the lock with or without a ticket, while
the holder releases and a simulated database clock moves on. The machine decides each try with
``check_turn`` and the lock decider; the model, without either, says a free lock goes to a ticket holder
only if no live ticket precedes it, and never to an acquire without a ticket while any ticket lives.
After every step: the decision agreed with the model, at most one holder, tokens strictly increasing,
and the tickets granted came in arrival order.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from domain.commands import Acquire, Release
from domain.decider import decide, fold
from domain.errors import LockHeld
from domain.events import stamp
from domain.queue import QueueAhead, Ticket, check_turn, first_live
from domain.resource import TtlBounds
from domain.state import LockState, initial_state

RESOURCE = "zone:A1"
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)


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

    def _live(self) -> list[Ticket]:
        return [t for t in self.tickets if t.deadline > self.now]

    def _model_free(self) -> bool:
        return self.state.status != "held" or (
            self.state.expires_at is not None and self.state.expires_at <= self.now
        )

    def _try(self, owner: str, ticket: int | None) -> None:
        head = first_live(self.tickets, self.now)
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
            assert named == head
            return
        assert model_grants, (owner, ticket, self.tickets)
        self.state = fold(self.state, stamp(events, self.now))
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
        if self.state.status == "held" and not self._model_free():
            assert self.state.owner is not None
            release = Release(RESOURCE, self.state.owner, self.state.fencing_token)
            self.state = fold(self.state, decide(self.state, release, self.now, BOUNDS))

    @rule(ms=st.integers(min_value=1, max_value=2_000))
    def time_passes(self, ms: int) -> None:
        self.now += timedelta(milliseconds=ms)

    @invariant()
    def tokens_strictly_increase(self) -> None:
        assert self.tokens == sorted(set(self.tokens))

    @invariant()
    def tickets_granted_in_arrival_order(self) -> None:
        assert self.granted_tickets == sorted(self.granted_tickets)


FairQueue.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestFairQueue = FairQueue.TestCase
