"""Stateful property test of the saga decider.

An orchestrator (and an admin) send random transitions, valid or not, to one saga of a few steps. The
machine keeps the saga folded with ``evolve`` and the full log of emitted events, and checks after every
step the saga invariants: no step starts after a failure or an abort; steps start in order; on abort
every completed step is compensated exactly once, last completed first; terminal states are final; the
fifth failure of one compensation, and only it, makes the saga stuck; a repeated transition changes
nothing; a route step (its locks one reservation) starts naming its reservation, the others name none.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from domain.errors import InvalidCommand
from domain.reservation import is_valid_reservation_id
from domain.saga import (
    COMPENSATION_COMPLETED,
    COMPENSATION_FAILED,
    COMPENSATION_STARTED,
    LAPSE_REASON,
    MAX_COMPENSATION_FAILURES,
    MAX_LOCKS_PER_ROUTE,
    SAGA_ABORT_REQUESTED,
    SAGA_ABORTED,
    SAGA_COMPLETED,
    SAGA_LEASE_EXPIRED,
    SAGA_LEASE_RENEWED,
    SAGA_STUCK,
    STEP_COMPLETED,
    STEP_FAILED,
    STEP_STARTED,
    TERMINAL,
    AbortSaga,
    CompleteCompensation,
    CompleteSaga,
    CompleteStep,
    ExpireSagaLease,
    FailCompensation,
    FailStep,
    Policy,
    RenewSagaLease,
    SagaCommand,
    SagaConflict,
    SagaDefinitionConflict,
    SagaEvent,
    SagaLeaseExtended,
    SagaNotFound,
    SagaState,
    StartCompensation,
    StartSaga,
    StartStep,
    StepDef,
    StepStarted,
    decide,
    evolve,
    fold,
    initial_saga,
    route_reservation_id,
)

STEPS = ("reserve", "pick", "move", "drop")
ROUTES = frozenset({"move"})  # taken as one reservation: every zone on the way
SAGA = "s-1"

steps = st.sampled_from(STEPS)
reasons = st.sampled_from(("motor", "blocked", "timeout"))
results = st.sampled_from((None, '{"bin": 4}', '{"bin": 5}'))
policies = st.sampled_from(("compensate", "forward"))
DEADLINE = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def _step_def(name: str) -> StepDef:
    if name in ROUTES:
        return StepDef(name, tuple(f"zone:{name}:{n}" for n in range(3)), route=True)
    return StepDef(name, (f"r:{name}",))


def _step_of(event: SagaEvent) -> str | None:
    return getattr(event, "step", None)


class SagaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state: SagaState = initial_saga(SAGA)
        self.log: list[SagaEvent] = []
        self.definition = StartSaga(SAGA, "move pallet", "agv-1", tuple(_step_def(s) for s in STEPS))

    @initialize(count=st.integers(min_value=3, max_value=len(STEPS)), policy=policies)
    def start(self, count: int, policy: Policy) -> None:
        steps = self.definition.steps[:count]
        with_steps = StartSaga(SAGA, "move pallet", "agv-1", steps, policy, lease_ms=5000)
        self.definition = with_steps
        self._send(with_steps)

    def _send(self, command: SagaCommand) -> list[SagaEvent] | None:
        before = self.state
        refused: SagaConflict | None = None
        events: list[SagaEvent] = []
        try:
            events = decide(before, command)
        except SagaConflict as refusal:
            refused = refusal
        if refused is not None:  # a refusal names the saga's status and the step it expects
            assert (refused.status, refused.expected_step) == (before.status, before.expected_step())
            return None
        self.state = fold(before, events)
        self.log.extend(events)
        assert self.state.version == before.version + len(events)
        if before.status in TERMINAL:
            assert events == [], "a terminal saga moved"
        if isinstance(command, RenewSagaLease):
            assert [e.type for e in events] == [SAGA_LEASE_RENEWED]  # every heartbeat renews
        elif not isinstance(command, FailCompensation) or self.state.status == "stuck":
            # The same transition again, now that it happened, changes nothing.
            assert decide(self.state, command) == []
        return events

    # --- the orchestrator's transitions (in any order: most are refused) ---

    @rule(step=steps)
    def start_step(self, step: str) -> None:
        self._send(StartStep(SAGA, step))

    @rule(step=steps, result=results)
    def complete_step(self, step: str, result: str | None) -> None:
        self._send(CompleteStep(SAGA, step, result))

    @rule(step=steps, reason=reasons)
    def fail_step(self, step: str, reason: str) -> None:
        self._send(FailStep(SAGA, step, reason))

    @rule(step=steps)
    def start_compensation(self, step: str) -> None:
        self._send(StartCompensation(SAGA, step))

    @rule(step=steps)
    def complete_compensation(self, step: str) -> None:
        self._send(CompleteCompensation(SAGA, step))

    @rule(step=steps, reason=reasons)
    def fail_compensation(self, step: str, reason: str) -> None:
        self._send(FailCompensation(SAGA, step, reason))

    @rule()
    def complete(self) -> None:
        self._send(CompleteSaga(SAGA))

    @rule(reason=reasons)
    def abort(self, reason: str) -> None:
        self._send(AbortSaga(SAGA, reason, "admin"))

    @rule()
    def heartbeat(self) -> None:
        self._send(RenewSagaLease(SAGA))

    @rule(late=st.booleans())
    def reaper_finds_the_lease(self, late: bool) -> None:
        """The head as loaded carries the stamped deadline; the reaper's clock is before it or past it."""
        loaded = replace(self.state, lease_expires_at=DEADLINE)
        now = DEADLINE + timedelta(milliseconds=1 if late else -1)
        events = decide(loaded, ExpireSagaLease(SAGA, now))
        if not late or self.state.status in TERMINAL:
            assert events == []
        else:
            assert events[0].type == SAGA_LEASE_EXPIRED
        self.state = fold(self.state, events)
        self.log.extend(events)
        if self.state.status not in TERMINAL:
            assert self.state.status == "compensating" or self.state.policy == "forward" or not events
        # The append stamps a new deadline: the same command on the state as folded changes nothing.
        assert decide(self.state, ExpireSagaLease(SAGA, now)) == []

    @rule()
    def start_again(self) -> None:
        """The same definition again is the create repeated: nothing happens."""
        assert decide(self.state, self.definition) == []

    # --- the orchestrator follows the saga's lead: the expected step's next transition ---

    @rule(data=st.data())
    def start_compensation_of_a_completed_step(self, data: st.DataObject) -> None:
        """Any completed step, not only the one the saga expects: all but the last completed are refused."""
        completed = [step.name for step in self.state.steps if step.status == "completed"]
        if completed:
            self._send(StartCompensation(SAGA, data.draw(st.sampled_from(completed))))

    @rule(outcomes=st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=16), reason=reasons)
    def drive(self, outcomes: list[int], reason: str) -> None:
        """A run of the saga's expected transitions: a step fails one time in five, a compensation three
        times in five (so sagas both finish compensating and get stuck)."""
        for outcome in outcomes:
            self._drive_once(outcome, reason)

    def _drive_once(self, outcome: int, reason: str) -> None:
        expected = self.state.expected_step()
        if expected is None:
            if self.state.status == "running":
                self._send(CompleteSaga(SAGA))
            return
        step = self.state.step(expected)
        assert step is not None
        command: SagaCommand
        if step.status == "pending":
            command = StartStep(SAGA, expected)
        elif step.status == "running":
            step_fails = outcome == 4
            command = FailStep(SAGA, expected, reason) if step_fails else CompleteStep(SAGA, expected, None)
        elif step.status == "completed":
            command = StartCompensation(SAGA, expected)
        else:
            assert step.status == "compensating"
            compensation_fails = outcome >= 2
            command = (
                FailCompensation(SAGA, expected, reason)
                if compensation_fails
                else CompleteCompensation(SAGA, expected)
            )
        assert self._send(command), f"the expected transition {command} was refused"

    # --- invariants over the log ---

    @invariant()
    def state_is_the_fold_of_the_log(self) -> None:
        replayed = initial_saga(SAGA)
        for event in self.log:
            replayed = evolve(replayed, event)
        assert replayed == self.state

    @invariant()
    def no_step_starts_after_a_failure_or_an_abort(self) -> None:
        stopped = False
        for event in self.log:
            if event.type in (STEP_FAILED, SAGA_ABORT_REQUESTED):
                stopped = True
            if event.type == STEP_STARTED:
                assert not stopped

    @invariant()
    def steps_start_in_order_one_at_a_time(self) -> None:
        started = [_step_of(e) for e in self.log if e.type == STEP_STARTED]
        names = [step.name for step in self.definition.steps]
        assert started == names[: len(started)]
        running = [s for s in self.state.steps if s.status == "running"]
        assert len(running) <= 1

    @invariant()
    def compensation_is_of_completed_steps_in_reverse_order_once_each(self) -> None:
        completed = [_step_of(e) for e in self.log if e.type == STEP_COMPLETED]
        started = [_step_of(e) for e in self.log if e.type == COMPENSATION_STARTED]
        compensated = [_step_of(e) for e in self.log if e.type == COMPENSATION_COMPLETED]
        assert len(set(compensated)) == len(compensated)
        assert started == list(reversed(completed))[: len(started)]
        assert compensated == started[: len(compensated)]
        if self.state.status == "aborted":
            assert compensated == list(reversed(completed))

    @invariant()
    def terminal_events_end_the_log(self) -> None:
        ends = [i for i, e in enumerate(self.log) if e.type in (SAGA_COMPLETED, SAGA_ABORTED, SAGA_STUCK)]
        assert ends == [] or ends == [len(self.log) - 1]

    @invariant()
    def stuck_exactly_at_the_fifth_failure_of_one_compensation_or_the_second_lapse(self) -> None:
        failures: dict[str | None, int] = {}
        lapses_in_a_row = 0
        for event in self.log:
            if event.type == COMPENSATION_FAILED:
                failures[_step_of(event)] = failures.get(_step_of(event), 0) + 1
            if event.type == SAGA_LEASE_RENEWED:
                lapses_in_a_row = 0
            if event.type == SAGA_LEASE_EXPIRED:
                lapses_in_a_row += 1
                assert getattr(event, "lapses", None) == lapses_in_a_row
        stuck = self.state.status == "stuck"
        worn_out = any(count >= MAX_COMPENSATION_FAILURES for count in failures.values())
        assert stuck == (worn_out or lapses_in_a_row == 2)
        assert all(count <= MAX_COMPENSATION_FAILURES for count in failures.values())

    @invariant()
    def a_route_step_starts_naming_its_reservation_and_no_other_step_names_one(self) -> None:
        for event in self.log:
            if isinstance(event, StepStarted):
                route = event.step in ROUTES
                assert event.reservation_id == (route_reservation_id(SAGA, event.step) if route else None)
        for step in self.state.steps:
            assert step.route == (step.name in ROUTES)
            assert (step.reservation_id is not None) == step.route

    @invariant()
    def completed_means_every_step_completed(self) -> None:
        if self.state.status == "completed":
            assert all(step.status == "completed" for step in self.state.steps)


SagaMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSagaDecider = SagaMachine.TestCase


def test_a_saga_never_started_is_not_found() -> None:
    with pytest.raises(SagaNotFound) as raised:
        decide(initial_saga("nope"), StartStep("nope", "a"))
    assert raised.value.code == "not_found"


def test_a_failed_first_step_aborts_at_once_and_a_late_step_is_compensated() -> None:
    start = StartSaga("s", "n", "o", (StepDef("a", ()), StepDef("b", ())))
    state = fold(initial_saga("s"), decide(initial_saga("s"), start))
    state = fold(state, decide(state, StartStep("s", "a")))
    # Aborted while step a runs: it may still finish, and is then compensated.
    state = fold(state, decide(state, AbortSaga("s", "stop", "admin")))
    assert state.status == "compensating"
    state = fold(state, decide(state, CompleteStep("s", "a", None)))
    assert state.expected_step() == "a"
    state = fold(state, decide(state, StartCompensation("s", "a")))
    state = fold(state, decide(state, CompleteCompensation("s", "a")))
    assert state.status == "aborted"

    other = fold(initial_saga("s"), decide(initial_saga("s"), start))
    other = fold(other, decide(other, StartStep("s", "a")))
    events = decide(other, FailStep("s", "a", "motor"))
    assert [e.type for e in events] == [STEP_FAILED, SAGA_ABORTED]


def _started(policy: Policy = "compensate") -> SagaState:
    start = StartSaga("s", "n", "o", (StepDef("a", ()), StepDef("b", ())), policy, lease_ms=3000)
    return fold(initial_saga("s"), decide(initial_saga("s"), start))


def _lapse(state: SagaState, late_ms: int = 1) -> list[SagaEvent]:
    loaded = replace(state, lease_expires_at=DEADLINE)
    return decide(loaded, ExpireSagaLease("s", DEADLINE + timedelta(milliseconds=late_ms)))


def test_a_live_lease_does_not_lapse_and_the_deadline_itself_does() -> None:
    state = _started()
    assert _lapse(state, late_ms=-1) == []
    assert [e.type for e in _lapse(state, late_ms=0)] == [
        SAGA_LEASE_EXPIRED,
        SAGA_ABORT_REQUESTED,
        SAGA_ABORTED,
    ]
    assert decide(state, ExpireSagaLease("s", DEADLINE)) == []  # no deadline stamped: nothing known to pass


def test_a_lapse_fails_the_running_step_and_compensates_the_completed_ones() -> None:
    state = _started()
    for command in (StartStep("s", "a"), CompleteStep("s", "a", '{"x": 1}'), StartStep("s", "b")):
        state = fold(state, decide(state, command))
    events = _lapse(state)
    assert [e.type for e in events] == [SAGA_LEASE_EXPIRED, STEP_FAILED]
    state = fold(state, events)
    assert (state.status, state.expected_step(), state.lease_lapsed) == ("compensating", "a", True)
    failed = state.step("b")
    assert failed is not None
    assert failed.error == LAPSE_REASON
    # Nobody compensates: the second lapse makes it stuck, naming the step left to compensate.
    events = _lapse(state)
    assert [e.type for e in events] == [SAGA_LEASE_EXPIRED, SAGA_STUCK]
    assert fold(state, events).status == "stuck"
    assert getattr(events[1], "step", None) == "a"


def test_a_heartbeat_after_a_lapse_gives_the_saga_another_lease() -> None:
    state = _started("forward")
    state = fold(state, decide(state, StartStep("s", "a")))
    events = _lapse(state)
    assert [e.type for e in events] == [SAGA_LEASE_EXPIRED]  # forward: only an orchestrator can go on
    state = fold(state, events)
    assert (state.status, state.step("a").status) == ("running", "running")  # type: ignore[union-attr]
    state = fold(state, decide(state, RenewSagaLease("s")))
    assert not state.lease_lapsed
    assert [e.type for e in _lapse(state)] == [SAGA_LEASE_EXPIRED]  # a first lapse again, not stuck


def test_a_lapse_completes_a_saga_whose_steps_all_completed_and_leaves_an_ended_one_alone() -> None:
    state = _started()
    for command in (StartStep("s", "a"), CompleteStep("s", "a"), StartStep("s", "b"), CompleteStep("s", "b")):
        state = fold(state, decide(state, command))
    events = _lapse(state)
    assert [e.type for e in events] == [SAGA_LEASE_EXPIRED, SAGA_COMPLETED]
    state = fold(state, events)
    assert _lapse(state) == []
    with pytest.raises(SagaConflict):
        decide(state, RenewSagaLease("s"))


def test_the_lease_is_not_part_of_the_definition() -> None:
    state = _started()
    again = StartSaga("s", "n", "o", (StepDef("a", ()), StepDef("b", ())), "compensate", lease_ms=9000)
    assert decide(state, again) == []
    assert state.lease_ms == 3000


def test_an_extension_after_an_outage_is_no_heartbeat() -> None:
    """The server starts the lease again after an outage; a lapse recorded before stays recorded, so the
    next lapse with nobody heartbeating still makes the saga stuck."""
    state = _started("forward")
    state = fold(state, _lapse(state))
    extended = evolve(state, SagaLeaseExtended())
    assert extended.version == state.version + 1
    assert extended.lease_lapsed
    assert [e.type for e in _lapse(extended)] == [SAGA_LEASE_EXPIRED, SAGA_STUCK]


def _start(*steps: StepDef) -> StartSaga:
    return StartSaga("s", "n", "o", steps)


def test_a_route_steps_locks_are_distinct_and_at_most_a_reservations_worth() -> None:
    for locks, problem in (
        (("zone:1", "zone:1"), "names each lock once"),
        ((), "a route step takes 1-"),
        (tuple(f"zone:{n}" for n in range(MAX_LOCKS_PER_ROUTE + 1)), "at most"),
    ):
        with pytest.raises(InvalidCommand, match=problem):
            decide(initial_saga("s"), _start(StepDef("drive", locks, route=True)))
    most = tuple(f"zone:{n}" for n in range(MAX_LOCKS_PER_ROUTE))
    assert decide(initial_saga("s"), _start(StepDef("drive", most, route=True)))
    # The same lock twice is still allowed in a step taking its locks one by one, as it was.
    assert decide(initial_saga("s"), _start(StepDef("drive", ("zone:1", "zone:1"))))


def test_a_route_is_part_of_the_definition() -> None:
    as_route = _start(StepDef("drive", ("zone:1", "zone:2"), route=True))
    state = fold(initial_saga("s"), decide(initial_saga("s"), as_route))
    assert decide(state, as_route) == []
    with pytest.raises(SagaDefinitionConflict):
        decide(state, _start(StepDef("drive", ("zone:1", "zone:2"))))


def test_a_route_step_names_its_reservation_from_the_start_and_when_it_starts() -> None:
    start = _start(StepDef("pick", ("pallet:1",)), StepDef("drive", ("zone:1", "zone:2"), route=True))
    state = fold(initial_saga("s"), decide(initial_saga("s"), start))
    drive = state.step("drive")
    assert drive is not None
    assert drive.reservation_id == route_reservation_id("s", "drive")
    state = fold(state, decide(state, StartStep("s", "pick")))
    state = fold(state, decide(state, CompleteStep("s", "pick")))
    assert decide(state, StartStep("s", "drive")) == [StepStarted("drive", drive.reservation_id)]


ids = st.text(alphabet="abc:.-_0", min_size=1, max_size=100).filter(lambda text: text.strip("."))


@given(saga=ids, step=ids, other_saga=ids, other_step=ids)
def test_route_reservation_ids_are_valid_and_one_per_saga_and_step(
    saga: str, step: str, other_saga: str, other_step: str
) -> None:
    reservation = route_reservation_id(saga, step)
    assert is_valid_reservation_id(reservation)
    assert reservation == route_reservation_id(saga, step)
    if (saga, step) != (other_saga, other_step):
        assert reservation != route_reservation_id(other_saga, other_step)
