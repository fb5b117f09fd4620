"""Stateful property test of the shared-lock decider (``domain/shared_lock.py``) against a simple model.

Agents acquire one resource in both modes and under a few limits, renew and release grants (their own,
others', ended ones), the reaper expires lapsed grants and a simulated database clock moves on. The model
is a dict of grants by token with their deadlines, written without the decider: a grant is made when no
live grant is exclusive (none at all for an exclusive one), the live grants' limit is the one asked and
leaves a place; renew and release need the owner's own live grant. After every step: the decider agreed
with the model, and the invariants hold: never two exclusive holders, never a reader with a writer,
never more than the limit, tokens strictly increasing. A second machine (``SharedQueue``) checks the queue's
rule (``check_queue``): no waiting writer is overtaken by a reader that came after it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from domain.errors import DomainError, InvalidCommand, LeaseExpired, NotHolder, NotOwner
from domain.queue import Ticket
from domain.resource import TtlBounds
from domain.shared_lock import (
    AcquireShared,
    ExpireShared,
    LimitMismatch,
    Mode,
    ReleaseShared,
    RenewShared,
    SharedAcquired,
    SharedCommand,
    SharedEvent,
    SharedExpired,
    SharedLockHeld,
    SharedLockState,
    SharedQueueAhead,
    check_queue,
    decide,
    fold,
    initial_state,
    stamp,
)

RESOURCE = "bay:charging"
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)
OWNERS = st.sampled_from(["agv-1", "agv-2", "agv-3", "forklift-1"])
MODES = st.sampled_from(["shared", "exclusive"])
LIMITS = st.sampled_from([None, None, 1, 2, 3])
TTLS = st.integers(min_value=10, max_value=3_000)


class Model:
    """Grants by token: (owner, mode, limit, deadline); ended grants are removed."""

    def __init__(self) -> None:
        self.grants: dict[int, tuple[str, str, int | None, datetime]] = {}
        self.version = 0

    def live(self, now: datetime) -> dict[int, tuple[str, str, int | None, datetime]]:
        return {token: g for token, g in self.grants.items() if g[3] > now}


class SharedLocks(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.state: SharedLockState = initial_state(RESOURCE)
        self.model = Model()
        self.tokens: list[int] = []

    def _decide(self, command: SharedCommand) -> list[SharedEvent] | DomainError:
        """The decider's events, or its refusal."""
        try:
            return decide(self.state, command, self.now, BOUNDS)
        except DomainError as error:
            return error

    def _apply(self, events: list[SharedEvent], model_events: int) -> None:
        assert len(events) == model_events, events
        self.state = fold(self.state, stamp(events, self.now))
        self.model.version += len(events)
        assert self.state.version == self.model.version

    @rule(owner=OWNERS, mode=MODES, limit=LIMITS, ttl=TTLS)
    def acquire(self, owner: str, mode: Mode, limit: int | None, ttl: int) -> None:
        live = self.model.live(self.now)
        limits = {g[2] for g in live.values()}
        mismatch = bool(live) and limits != {limit}
        if mode == "exclusive":
            grantable = not live
        else:
            grantable = all(g[1] == "shared" for g in live.values()) and (limit is None or len(live) < limit)
        events = self._decide(AcquireShared(RESOURCE, owner, mode, ttl, limit))
        if isinstance(events, LimitMismatch):
            assert mismatch
            return
        if isinstance(events, SharedLockHeld):
            assert not mismatch
            assert not grantable
            assert events.conflicts
            assert all(g.fencing_token in live for g in events.conflicts)
            return
        assert isinstance(events, list), events
        assert not mismatch
        assert grantable, (owner, mode, limit, live)
        lapsed = [token for token, g in self.model.grants.items() if g[3] <= self.now]
        assert [e.fencing_token for e in events if isinstance(e, SharedExpired)] == sorted(lapsed)
        granted = events[-1]
        assert isinstance(granted, SharedAcquired)
        assert granted.fencing_token == self.model.version + len(events)
        for token in lapsed:
            del self.model.grants[token]
        self.model.grants[granted.fencing_token] = (
            owner, mode, limit, self.now + timedelta(milliseconds=ttl),
        )  # fmt: skip
        self.tokens.append(granted.fencing_token)
        self._apply(events, len(lapsed) + 1)

    def _pick(self, data: st.DataObject) -> int:
        known = sorted(self.tokens) or [1]
        return data.draw(st.sampled_from([*known, known[-1] + 1]))

    def _check_holder(self, owner: str, token: int, error: DomainError | None) -> bool:
        """Whether the model lets ``owner`` act on ``token``; asserts the decider's refusal matches."""
        grant = self.model.grants.get(token)
        if grant is None:
            assert isinstance(error, NotHolder)
            assert not isinstance(error, NotOwner)
            return False
        if grant[0] != owner:
            assert isinstance(error, NotOwner)
            return False
        if grant[3] <= self.now:
            assert isinstance(error, LeaseExpired)
            return False
        assert error is None, error
        return True

    @rule(owner=OWNERS, data=st.data(), ttl=st.one_of(st.none(), TTLS))
    def renew(self, owner: str, data: st.DataObject, ttl: int | None) -> None:
        token = self._pick(data)
        events = self._decide(RenewShared(RESOURCE, owner, token, ttl))
        if isinstance(events, DomainError):
            assert not isinstance(events, InvalidCommand)
            self._check_holder(owner, token, events)
            return
        assert self._check_holder(owner, token, None)
        g = self.model.grants[token]
        kept = ttl if ttl is not None else self.state_ttl(token)
        self.model.grants[token] = (g[0], g[1], g[2], self.now + timedelta(milliseconds=kept))
        self._apply(events, 1)

    def state_ttl(self, token: int) -> int:
        return next(g.ttl_ms for g in self.state.grants if g.fencing_token == token)

    @rule(owner=OWNERS, data=st.data())
    def release(self, owner: str, data: st.DataObject) -> None:
        token = self._pick(data)
        events = self._decide(ReleaseShared(RESOURCE, owner, token))
        if isinstance(events, DomainError):
            self._check_holder(owner, token, events)
            return
        assert self._check_holder(owner, token, None)
        del self.model.grants[token]
        self._apply(events, 1)

    @rule()
    def reap(self) -> None:
        events = decide(self.state, ExpireShared(RESOURCE), self.now, BOUNDS)
        lapsed = sorted(token for token, g in self.model.grants.items() if g[3] <= self.now)
        assert [e.fencing_token for e in events] == lapsed
        for token in lapsed:
            del self.model.grants[token]
        self._apply(events, len(lapsed))

    @rule(ms=st.integers(min_value=1, max_value=2_000))
    def advance(self, ms: int) -> None:
        self.now += timedelta(milliseconds=ms)

    @invariant()
    def same_grants(self) -> None:
        assert {g.fencing_token: (g.owner, g.mode, g.limit, g.expires_at) for g in self.state.grants} == (
            self.model.grants
        )

    @invariant()
    def exclusion_holds(self) -> None:
        live = self.state.live(self.now)
        exclusive = [g for g in live if g.mode == "exclusive"]
        assert len(exclusive) <= 1
        assert not exclusive or len(live) == 1  # a writer holds alone
        limits = {g.limit for g in live}
        assert len(limits) <= 1  # the live grants agree on their limit
        limit = next(iter(limits), None)
        assert limit is None or len(live) <= limit

    @invariant()
    def tokens_increase(self) -> None:
        assert self.tokens == sorted(set(self.tokens))


SharedLocks.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestSharedLocks = SharedLocks.TestCase


def test_a_reader_and_a_writer_take_turns() -> None:
    state = initial_state(RESOURCE)
    read = decide(state, AcquireShared(RESOURCE, "agv-1", "shared", 1_000), T0, BOUNDS)
    state = fold(state, stamp(read, T0))
    with pytest.raises(SharedLockHeld) as held:
        decide(state, AcquireShared(RESOURCE, "agv-2", "exclusive", 1_000), T0, BOUNDS)
    assert [g.owner for g in held.value.conflicts] == ["agv-1"]
    assert held.value.code == "lock_held"
    later = T0 + timedelta(seconds=1)  # the reader's grant lapsed: expired in the writer's decision
    events = decide(state, AcquireShared(RESOURCE, "agv-2", "exclusive", 1_000), later, BOUNDS)
    assert [type(e) for e in events] == [SharedExpired, SharedAcquired]
    assert events[-1].fencing_token == 3


def test_a_limit_is_agreed_by_every_holder() -> None:
    state = initial_state(RESOURCE)
    state = fold(state, stamp(decide(state, AcquireShared(RESOURCE, "a", "shared", 1_000, 2), T0), T0))
    with pytest.raises(LimitMismatch) as refused:
        decide(state, AcquireShared(RESOURCE, "b", "shared", 1_000, 3), T0)
    assert refused.value.limit == 2
    assert refused.value.code == "limit_mismatch"


def test_readers_behind_a_waiting_writer_wait_behind_it() -> None:
    writer = Ticket(5, "writer", T0 + timedelta(seconds=10))
    reader = AcquireShared(RESOURCE, "late-reader", "shared", 1_000)
    with pytest.raises(SharedQueueAhead):
        check_queue(reader, writer, writer, None, T0)  # no ticket: behind every waiter
    with pytest.raises(SharedQueueAhead):
        check_queue(reader, writer, writer, 7, T0)  # a ticket after the writer's
    early = Ticket(3, "early-reader", T0 + timedelta(seconds=10))
    check_queue(reader, early, writer, 4, T0)  # readers ahead of the writer are granted together
    semaphore = AcquireShared(RESOURCE, "agv-9", "shared", 1_000, 2)
    with pytest.raises(SharedQueueAhead):
        check_queue(semaphore, early, None, 4, T0)  # a permit goes to the first waiter


class SharedQueue(RuleBasedStateMachine):
    """Waiters of both modes join a read/write lock's queue (tickets in arrival order, live for their
    wait), leave it, and try with or without a ticket, while holders release and the clock moves on. Each
    try is decided by the decider and ``check_queue`` on the queue's first live ticket and first live
    exclusive one, as the store loads them. After every step: no reader was granted while a writer that
    came before it waited, no grant jumped an earlier waiter of an exclusive acquire, and the exclusion
    invariants hold."""

    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.state: SharedLockState = initial_state(RESOURCE)
        self.tickets: dict[int, tuple[str, Mode, datetime]] = {}  # ticket -> owner, mode, deadline
        self.next_ticket = 1
        self.next_owner = 1

    def _live(self) -> dict[int, tuple[str, Mode, datetime]]:
        return {t: w for t, w in self.tickets.items() if w[2] > self.now}

    def _first(self, exclusive_only: bool) -> Ticket | None:
        live = [(t, w) for t, w in sorted(self._live().items()) if not exclusive_only or w[1] == "exclusive"]
        return Ticket(live[0][0], live[0][1][0], live[0][1][2]) if live else None

    @rule(mode=MODES, wait_ms=st.integers(min_value=1, max_value=3_000))
    def join(self, mode: Mode, wait_ms: int) -> None:
        owner = f"agv-{self.next_owner}"
        self.next_owner += 1
        self.tickets[self.next_ticket] = (owner, mode, self.now + timedelta(milliseconds=wait_ms))
        self.next_ticket += 1

    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        if self.tickets:
            del self.tickets[data.draw(st.sampled_from(sorted(self.tickets)))]

    @rule(data=st.data(), mode=MODES, queued=st.booleans())
    def attempt(self, data: st.DataObject, mode: Mode, queued: bool) -> None:
        live = sorted(self._live())
        ticket = data.draw(st.sampled_from(live)) if queued and live else None
        owner = "walk-in" if ticket is None else self.tickets[ticket][0]
        mode = mode if ticket is None else self.tickets[ticket][1]
        command = AcquireShared(RESOURCE, owner, mode, 5_000)
        try:
            events = decide(self.state, command, self.now, BOUNDS)
            check_queue(command, self._first(False), self._first(True), ticket, self.now)
        except (SharedLockHeld, SharedQueueAhead):
            return
        ahead = [t for t in self._live() if ticket is None or t < ticket]
        writers_ahead = [t for t in ahead if self.tickets[t][1] == "exclusive"]
        assert not writers_ahead, (mode, ticket, self.tickets)  # no waiting writer is overtaken
        if mode == "exclusive":
            assert not ahead, (ticket, self.tickets)  # a writer waits its turn behind every waiter
        self.state = fold(self.state, stamp(events, self.now))
        if ticket is not None:
            del self.tickets[ticket]

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        live = self.state.live(self.now)
        if live:
            grant = data.draw(st.sampled_from(live))
            events = decide(self.state, ReleaseShared(RESOURCE, grant.owner, grant.fencing_token), self.now)
            self.state = fold(self.state, stamp(events, self.now))

    @rule(ms=st.integers(min_value=1, max_value=2_000))
    def advance(self, ms: int) -> None:
        self.now += timedelta(milliseconds=ms)

    @invariant()
    def exclusion_holds(self) -> None:
        live = self.state.live(self.now)
        assert not any(g.mode == "exclusive" for g in live) or len(live) == 1


SharedQueue.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestSharedQueue = SharedQueue.TestCase
