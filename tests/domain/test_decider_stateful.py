"""Stateful property test of the lock decider.

Several owners send random commands to two resources while a simulated database clock moves forward.
Next to the decider's own state (folded with ``evolve``) the machine keeps an independent shadow model
of each lock and the full log of emitted events with the instant each was decided, and checks after
every step that the decider agrees with the model and that the lock's safety properties hold. Leases are
also handed off, accepted and declined (docs/decisions/0047-lease-hand-off.md), so every property below
holds across hand-offs too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from domain.commands import Accept, Acquire, Command, Decline, Expire, ForceRelease, HandOff, Release, Renew
from domain.decider import decide, evolve, fold
from domain.errors import DomainError, InvalidCommand, LeaseExpired, LockHeld, NotHolder, NotOwner
from domain.events import (
    LOCK_EXPIRED,
    LOCK_FORCE_RELEASED,
    LOCK_RELEASED,
    Event,
    LockAcquired,
    LockExpired,
    LockForceReleased,
    LockHandedOff,
    LockReleased,
    LockRenewed,
    stamp,
)
from domain.state import LockState, initial_state

RESOURCES = ("pallet:42", "zone:A3")
OWNERS = ("agv-1", "agv-2", "agv-3")
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)

resources = st.sampled_from(RESOURCES)
owners = st.sampled_from(OWNERS)
ttls = st.integers(min_value=1_000, max_value=30_000)
TokenChoice = Literal["known", "current", "stale", "next", "arbitrary"]
token_choices: st.SearchStrategy[TokenChoice] = st.sampled_from(
    ["known", "known", "known", "current", "stale", "next", "arbitrary"]
)

ShadowStatus = Literal["never", "held", "released", "expired", "forced"]


@dataclass
class Shadow:
    """An independent model of one lock, kept without ``evolve``."""

    status: ShadowStatus = "never"
    holder: str | None = None
    token: int = 0
    ttl_ms: int | None = None
    expires_at: datetime | None = None
    # The giver of a hand-off not yet taken up, and the log length right after it: any later event on
    # the lock (a renew, release, expiry, another hand-off) takes it off.
    pending: tuple[str, int] | None = None

    def live(self, now: datetime) -> bool:
        return self.status == "held" and self.expires_at is not None and now < self.expires_at

    def lapsed(self, now: datetime) -> bool:
        return self.status == "held" and self.expires_at is not None and now >= self.expires_at

    def lease(self) -> tuple[str, int, datetime]:
        """Owner, token and deadline of the last lease granted (it must exist)."""
        assert self.holder is not None
        assert self.expires_at is not None
        return self.holder, self.token, self.expires_at


@dataclass
class Lock:
    state: LockState
    shadow: Shadow = field(default_factory=Shadow)
    log: list[tuple[datetime, Event]] = field(default_factory=list)

    @property
    def events(self) -> list[Event]:
        return [event for _, event in self.log]


def live_tokens(log: list[tuple[datetime, Event]], now: datetime) -> dict[int, str]:
    """Leases that the log alone says are live at ``now``: granted, not ended, deadline not reached."""
    grants: dict[int, tuple[str, datetime]] = {}
    ended: set[int] = set()
    for _, event in log:
        if isinstance(event, LockHandedOff):  # ends the giver's lease, begins the receiver's
            ended.add(event.from_token)
        if isinstance(event, LockAcquired | LockRenewed | LockHandedOff):
            assert event.expires_at is not None
            grants[event.fencing_token] = (event.owner, event.expires_at)
        else:
            ended.add(event.fencing_token)
    return {
        token: owner for token, (owner, deadline) in grants.items() if token not in ended and now < deadline
    }


class LockDeciderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.locks = {resource: Lock(initial_state(resource)) for resource in RESOURCES}
        # The token each owner last received from a successful acquire, per resource.
        self.known: dict[tuple[str, str], int] = {}

    # --- helpers -------------------------------------------------------------------------------------

    def run(self, command: Command) -> list[Event] | DomainError:
        lock = self.locks[command.resource]
        before = lock.state
        error: DomainError | None = None
        try:
            events = stamp(decide(lock.state, command, self.now), self.now)  # appended at once
        except DomainError as err:
            error = err
        if error is not None:
            assert error.resource == command.resource
            assert lock.state is before
            return error
        for event in events:
            assert event.resource == command.resource
            lock.state = evolve(lock.state, event)
            lock.log.append((self.now, event))
        return events

    def pick_token(self, owner: str, resource: str, choice: TokenChoice, arbitrary: int) -> int:
        known = self.known.get((owner, resource), 0)
        current = self.locks[resource].shadow.token
        if choice == "known":
            return known
        if choice == "current":
            return current
        if choice == "stale":
            return known - 1
        if choice == "next":
            return current + 1
        return arbitrary

    def expected_holder_error(self, resource: str, owner: str, token: int) -> type[DomainError] | None:
        """The rejection renew and release must give, per DESIGN.md "Lock semantics"."""
        sh = self.locks[resource].shadow
        if sh.holder is not None and owner != sh.holder:
            return NotOwner  # the API's 403 once the owner is the authenticated principal
        if sh.status == "never" or token != sh.token:
            return NotHolder
        if sh.lapsed(self.now) or sh.status == "expired":
            return LeaseExpired
        if sh.status != "held":
            return NotHolder
        return None

    def awaiting_from(self, resource: str) -> str | None:
        """The giver of the hand-off of ``resource`` not yet taken up, by the model."""
        lock = self.locks[resource]
        pending = lock.shadow.pending
        if pending is None or pending[1] != len(lock.log):
            return None
        return pending[0]

    # --- rules ---------------------------------------------------------------------------------------

    @rule(resource=resources, owner=owners, ttl_ms=ttls)
    def acquire(self, resource: str, owner: str, ttl_ms: int) -> None:
        lock = self.locks[resource]
        sh = lock.shadow
        version = len(lock.log)
        was_live = sh.live(self.now)
        was_lapsed = sh.lapsed(self.now)
        previous_tokens = [e.fencing_token for e in lock.events if isinstance(e, LockAcquired)]
        live_before = live_tokens(lock.log, self.now)

        result = self.run(Acquire(resource, owner, ttl_ms))

        if was_live:
            assert isinstance(result, LockHeld), result
            assert result.holder == sh.holder
            assert result.expires_at == sh.expires_at
            assert result.fencing_token == sh.token
            assert len(live_before) == 1
            return
        assert isinstance(result, list), result
        assert not live_before, "acquired while another lease was live"
        if was_lapsed:
            assert result[0] == LockExpired(resource, *sh.lease())
            token = version + 2
        else:
            token = version + 1
        deadline = self.now + timedelta(milliseconds=ttl_ms)
        assert result[-1] == LockAcquired(resource, owner, token, ttl_ms, deadline)
        assert len(result) == (2 if was_lapsed else 1)
        assert all(token > previous for previous in previous_tokens)

        lock.shadow = Shadow("held", owner, token, ttl_ms, deadline)
        self.known[(owner, resource)] = token

    @rule(
        resource=resources,
        owner=owners,
        choice=token_choices,
        arbitrary=st.integers(min_value=-1, max_value=40),
        ttl_ms=st.none() | ttls,
    )
    def renew(
        self, resource: str, owner: str, choice: TokenChoice, arbitrary: int, ttl_ms: int | None
    ) -> None:
        lock = self.locks[resource]
        sh = lock.shadow
        token = self.pick_token(owner, resource, choice, arbitrary)
        expected = self.expected_holder_error(resource, owner, token)

        result = self.run(Renew(resource, owner, token, ttl_ms))

        if expected is not None:
            assert type(result) is expected, (expected, result)
            if isinstance(result, LeaseExpired):
                assert result.expired_at == sh.expires_at
            return
        assert isinstance(result, list), result
        # Success only for the current owner and token, and only while the lease is live.
        assert owner == sh.holder
        assert token == sh.token
        assert sh.expires_at is not None
        assert self.now < sh.expires_at, "renewed a lapsed lease"
        effective_ttl = ttl_ms if ttl_ms is not None else sh.ttl_ms
        assert effective_ttl is not None
        deadline = self.now + timedelta(milliseconds=effective_ttl)
        assert result == [LockRenewed(resource, owner, token, effective_ttl, deadline)]
        sh.ttl_ms = effective_ttl
        sh.expires_at = deadline

    @rule(
        resource=resources,
        owner=owners,
        choice=token_choices,
        arbitrary=st.integers(min_value=-1, max_value=40),
    )
    def release(self, resource: str, owner: str, choice: TokenChoice, arbitrary: int) -> None:
        lock = self.locks[resource]
        sh = lock.shadow
        token = self.pick_token(owner, resource, choice, arbitrary)
        expected = self.expected_holder_error(resource, owner, token)

        result = self.run(Release(resource, owner, token))

        if expected is not None:
            assert type(result) is expected, (expected, result)
            return
        assert isinstance(result, list), result
        assert owner == sh.holder
        assert token == sh.token
        assert sh.expires_at is not None
        assert self.now < sh.expires_at, "released a lapsed lease"
        assert result == [LockReleased(resource, owner, token, sh.expires_at)]
        sh.status = "released"

    @rule(resource=resources)
    def expire(self, resource: str) -> None:
        sh = self.locks[resource].shadow
        lapsed = sh.lapsed(self.now)
        result = self.run(Expire(resource))
        assert isinstance(result, list), result
        if not lapsed:
            assert result == []
            return
        assert result == [LockExpired(resource, *sh.lease())]
        sh.status = "expired"

    @rule(resource=resources, reason=st.sampled_from(["maintenance", "robot powered off", "x"]))
    def force_release(self, resource: str, reason: str) -> None:
        sh = self.locks[resource].shadow
        live = sh.live(self.now)
        lapsed = sh.lapsed(self.now)
        result = self.run(ForceRelease(resource, reason))
        assert isinstance(result, list), result
        if live:
            assert result == [LockForceReleased(resource, *sh.lease(), reason)]
            sh.status = "forced"
        elif lapsed:
            assert result == [LockExpired(resource, *sh.lease())]
            sh.status = "expired"
        else:
            assert result == []

    def holder_or(self, resource: str, owner: str | None) -> str:
        """``owner``, or (None) the lock's last holder: hand-offs and their take-ups by the agent they
        concern, often enough for the rules after them to be explored."""
        return owner if owner is not None else (self.locks[resource].shadow.holder or OWNERS[0])

    @rule(
        resource=resources,
        owner=st.none() | owners,
        to=owners,
        choice=token_choices,
        arbitrary=st.integers(min_value=-1, max_value=40),
        within_ms=ttls,
    )
    def hand_off(
        self, resource: str, owner: str | None, to: str, choice: TokenChoice, arbitrary: int, within_ms: int
    ) -> None:
        owner = self.holder_or(resource, owner)
        lock = self.locks[resource]
        token = self.pick_token(owner, resource, choice, arbitrary)
        expected = InvalidCommand if to == owner else self.expected_holder_error(resource, owner, token)
        version = len(lock.log)
        live_before = live_tokens(lock.log, self.now)

        result = self.run(HandOff(resource, owner, token, to, within_ms))

        if expected is not None:
            assert type(result) is expected, (expected, result)
            return
        assert isinstance(result, list), result
        assert live_before == {token: owner}
        deadline = self.now + timedelta(milliseconds=within_ms)
        assert result == [LockHandedOff(resource, to, version + 1, within_ms, deadline, owner, token)]
        # No instant without a holder: the receiver holds from the very instant the giver stops.
        assert live_tokens(lock.log, self.now) == {version + 1: to}
        lock.shadow = Shadow("held", to, version + 1, within_ms, deadline, (owner, len(lock.log)))

    @rule(resource=resources, owner=st.none() | owners, ttl_ms=ttls, accept=st.booleans())
    def take_up(self, resource: str, owner: str | None, ttl_ms: int, accept: bool) -> None:
        """The receiver accepts (renewing for its own TTL, learning its token) or declines."""
        owner = self.holder_or(resource, owner)
        lock = self.locks[resource]
        sh = lock.shadow
        awaiting = self.awaiting_from(resource) is not None and sh.holder == owner

        result = self.run(Accept(resource, owner, ttl_ms) if accept else Decline(resource, owner))

        if not awaiting:
            assert type(result) is NotHolder, result
            return
        if sh.lapsed(self.now):
            assert type(result) is LeaseExpired, result
            assert result.expired_at == sh.expires_at
            return
        assert isinstance(result, list), result
        if accept:
            deadline = self.now + timedelta(milliseconds=ttl_ms)
            assert result == [LockRenewed(resource, owner, sh.token, ttl_ms, deadline)]
            sh.ttl_ms, sh.expires_at = ttl_ms, deadline
            self.known[(owner, resource)] = sh.token
        else:
            assert sh.expires_at is not None
            assert result == [LockReleased(resource, owner, sh.token, sh.expires_at)]
            sh.status = "released"

    @rule(
        resource=resources,
        to=owners,
        within_ms=ttls,
        pause_ms=st.integers(min_value=0, max_value=40_000),
        ttl_ms=ttls,
        accept=st.booleans(),
    )
    def relay(self, resource: str, to: str, within_ms: int, pause_ms: int, ttl_ms: int, accept: bool) -> None:
        """The holder hands its lease to ``to`` with its current token, and after a pause (past the
        deadline at times) the receiver takes it up: the whole hand-off, as agents run it."""
        self.hand_off(resource, None, to, "current", 0, within_ms)
        self.now += timedelta(milliseconds=pause_ms)
        self.take_up(resource, None, ttl_ms, accept)

    @rule(step_ms=st.integers(min_value=0, max_value=40_000))
    def advance_clock(self, step_ms: int) -> None:
        self.now += timedelta(milliseconds=step_ms)

    @rule(resource=resources, offset_ms=st.sampled_from([-1, 0]))
    def advance_to_deadline(self, resource: str, offset_ms: int) -> None:
        """Land exactly on (or one millisecond before) a live lease's deadline: the boundary of expiry."""
        sh = self.locks[resource].shadow
        if sh.status == "held" and sh.expires_at is not None:
            target = sh.expires_at + timedelta(milliseconds=offset_ms)
            if target > self.now:
                self.now = target

    # --- invariants ----------------------------------------------------------------------------------

    @invariant()
    def at_most_one_live_holder(self) -> None:
        for lock in self.locks.values():
            live = live_tokens(lock.log, self.now)
            assert len(live) <= 1, live
            state_live = lock.state.is_live(self.now)
            assert state_live == bool(live)
            if state_live:
                assert live == {lock.state.fencing_token: lock.state.owner}

    @invariant()
    def fencing_tokens_strictly_increase(self) -> None:
        for lock in self.locks.values():
            starts = LockAcquired | LockHandedOff
            tokens = [e.fencing_token for e in lock.events if isinstance(e, starts)]
            assert tokens == sorted(set(tokens))
            current = 0
            for version, event in enumerate(lock.events, start=1):
                if isinstance(event, starts):
                    assert event.fencing_token == version
                    if isinstance(event, LockHandedOff):  # handed on by the lease of the token before
                        assert event.from_token == current
                    current = event.fencing_token
                else:
                    # Every other event speaks of the lease begun by the latest acquire or hand-off.
                    assert event.fencing_token == current

    @invariant()
    def expired_leases_are_never_resurrected(self) -> None:
        for lock in self.locks.values():
            ended: set[int] = set()
            last_deadline: dict[int, datetime] = {}
            for decided_at, event in lock.log:
                if isinstance(event, LockHandedOff):
                    assert event.from_token not in ended, "handed off an ended lease"
                    assert decided_at < last_deadline[event.from_token], "handed off a lapsed lease"
                    ended.add(event.from_token)
                if isinstance(event, LockRenewed):
                    assert event.fencing_token not in ended, "renewed an ended lease"
                    assert decided_at < last_deadline[event.fencing_token], "renewed a lapsed lease"
                if isinstance(event, LockAcquired | LockRenewed | LockHandedOff):
                    assert event.expires_at is not None
                    last_deadline[event.fencing_token] = event.expires_at
                else:
                    assert event.fencing_token not in ended, "ended a lease twice"
                    ended.add(event.fencing_token)
                    if isinstance(event, LockExpired):
                        assert decided_at >= event.expires_at, "expired a live lease"
                    else:
                        assert decided_at < event.expires_at, "released a lapsed lease"

    @invariant()
    def fold_reproduces_state(self) -> None:
        for resource, lock in self.locks.items():
            assert fold(initial_state(resource), lock.events) == lock.state
            assert lock.state.version == len(lock.log)

    @invariant()
    def state_matches_shadow_model(self) -> None:
        ended_by = {"expired": LOCK_EXPIRED, "released": LOCK_RELEASED, "forced": LOCK_FORCE_RELEASED}
        for resource, lock in self.locks.items():
            state, sh = lock.state, lock.shadow
            assert state.handed_off_by == self.awaiting_from(resource)
            assert state.status == ("held" if sh.status == "held" else "free")
            assert state.fencing_token == sh.token
            assert state.owner == sh.holder
            assert state.expires_at == sh.expires_at
            assert state.ended_by == ended_by.get(sh.status)
            if sh.status == "held":
                assert state.ttl_ms == sh.ttl_ms
            assert state.is_live(self.now) == sh.live(self.now)
            assert state.is_lapsed(self.now) == sh.lapsed(self.now)


LockDeciderMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLockDecider = LockDeciderMachine.TestCase
