"""The SDK's circuit breaker (lockledger_breaker), driven by a fake clock, through the surface its users
call: ``acquire_permission``, then ``on_success``, ``on_error`` or ``release_permission``."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockledger_breaker import BreakerConfig, BreakerMetrics, CircuitBreaker, CircuitOpen, State


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


Transition = tuple[State, State]


class Watched(CircuitBreaker):
    """A breaker that notes each state change its public methods make (the tests' window into it)."""

    def __init__(self, config: BreakerConfig, clock: FakeClock) -> None:
        super().__init__(config, name="test", clock=clock)
        self.changes: list[Transition] = []

    def _noting(self, before: State) -> None:
        if self._state is not before:
            self.changes.append((before, self._state))

    def acquire_permission(self) -> None:
        before = self._state
        try:
            super().acquire_permission()
        finally:
            self._noting(before)

    def on_success(self, duration_s: float) -> None:
        before = self._state
        super().on_success(duration_s)
        self._noting(before)

    def on_error(self, duration_s: float) -> None:
        before = self._state
        super().on_error(duration_s)
        self._noting(before)

    def reset(self) -> None:
        before = self._state
        super().reset()
        self._noting(before)

    @property
    def state(self) -> State:
        before = self._state
        now = super().state
        self._noting(before)
        return now


def make(
    clock: FakeClock | None = None, **overrides: object
) -> tuple[CircuitBreaker, FakeClock, list[Transition]]:
    clock = clock if clock is not None else FakeClock()
    base: dict[str, object] = {
        "failure_rate_threshold": 50.0,
        "sliding_window_size": 10,
        "minimum_number_of_calls": 4,
        "wait_duration_in_open": 30.0,
        "permitted_calls_in_half_open": 2,
        "slow_call_duration": 5.0,
    }
    base.update(overrides)
    breaker = Watched(BreakerConfig(**base), clock)  # type: ignore[arg-type]
    return breaker, clock, breaker.changes


def succeed(breaker: CircuitBreaker, n: int = 1, duration: float = 0.01) -> None:
    for _ in range(n):
        breaker.acquire_permission()
        breaker.on_success(duration)


def fail(breaker: CircuitBreaker, n: int = 1, duration: float = 0.01) -> None:
    for _ in range(n):
        breaker.acquire_permission()
        breaker.on_error(duration)


def trip(breaker: CircuitBreaker) -> None:
    fail(breaker, 4)
    assert state_of(breaker) is State.OPEN


def state_of(breaker: CircuitBreaker) -> State:
    return breaker.state  # a call, so that mypy does not narrow the property between assertions


def transitions(events: list[Transition]) -> list[Transition]:
    return list(events)


# -- states and values --------------------------------------------------------------------------------


def test_state_values_are_lowercase_names() -> None:
    assert [s.value for s in State] == ["closed", "open", "half_open"]


def test_defaults_match_resilience4j() -> None:
    c = BreakerConfig()
    assert (c.failure_rate_threshold, c.slow_call_rate_threshold, c.slow_call_duration) == (
        50.0,
        100.0,
        5.0,
    )
    assert (c.sliding_window_type, c.sliding_window_size, c.minimum_number_of_calls) == ("count", 100, 10)
    assert (c.wait_duration_in_open, c.permitted_calls_in_half_open, c.max_wait_in_half_open) == (
        30.0,
        5,
        0.0,
    )
    assert CircuitBreaker().state is State.CLOSED


@pytest.mark.parametrize(
    "bad",
    [
        {"failure_rate_threshold": 0.0},
        {"slow_call_rate_threshold": 101.0},
        {"sliding_window_size": 0},
        {"minimum_number_of_calls": 0},
        {"permitted_calls_in_half_open": 0},
        {"sliding_window_type": "sliding"},
        {"wait_duration_in_open": -1.0},
    ],
)
def test_invalid_config_is_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        BreakerConfig(**bad)  # type: ignore[arg-type]


# -- CLOSED -> OPEN -----------------------------------------------------------------------------------


def test_minimum_number_of_calls_is_respected() -> None:
    breaker, _, events = make()
    fail(breaker, 3)  # 100 % failures, but only 3 of the 4 calls needed
    assert state_of(breaker) is State.CLOSED
    m = breaker.metrics
    assert (m.calls, m.failures, m.failure_rate, m.slow_call_rate) == (3, 3, -1.0, -1.0)
    fail(breaker)
    assert state_of(breaker) is State.OPEN
    assert transitions(events) == [(State.CLOSED, State.OPEN)]


def test_failure_rate_below_threshold_stays_closed_and_at_threshold_opens() -> None:
    breaker, _, _ = make(failure_rate_threshold=50.0)
    succeed(breaker, 3)
    fail(breaker, 2)  # 2 / 5 = 40 %
    assert state_of(breaker) is State.CLOSED
    assert breaker.metrics.failure_rate == pytest.approx(40.0)
    fail(breaker)  # 3 / 6 = 50 %
    assert state_of(breaker) is State.OPEN


def test_count_window_forgets_old_calls() -> None:
    breaker, _, _ = make(sliding_window_size=5, minimum_number_of_calls=5, failure_rate_threshold=60.0)
    fail(breaker, 2)
    succeed(breaker, 3)  # 2 / 5 = 40 %
    assert breaker.metrics.failure_rate == pytest.approx(40.0)
    succeed(breaker, 2)  # the two failures fall out of the window
    m = breaker.metrics
    assert (m.calls, m.failures, m.failure_rate) == (5, 0, 0.0)
    fail(breaker, 2)  # 2 / 5 again: 40 %
    fail(breaker)  # 3 / 5 = 60 %
    assert state_of(breaker) is State.OPEN


def test_count_window_minimum_is_capped_by_window_size() -> None:
    breaker, _, _ = make(sliding_window_size=3, minimum_number_of_calls=10)
    fail(breaker, 3)
    assert state_of(breaker) is State.OPEN


def test_time_window_forgets_calls_older_than_its_size() -> None:
    breaker, clock, _ = make(sliding_window_type="time", sliding_window_size=10, minimum_number_of_calls=4)
    fail(breaker, 3)
    clock.advance(9.5)  # still within the last 10 seconds
    assert breaker.metrics.calls == 3
    clock.advance(0.6)  # now 10.1 s later: the first second's bucket has left the window
    m = breaker.metrics
    assert (m.calls, m.failures) == (0, 0)
    fail(breaker)  # only 1 call in the window: below the minimum
    assert state_of(breaker) is State.CLOSED
    clock.advance(3.0)
    fail(breaker, 2)
    succeed(breaker)
    assert breaker.metrics.calls == 4
    assert state_of(breaker) is State.OPEN  # 3 / 4 = 75 %


def test_time_window_counts_calls_across_buckets_and_skips_long_gaps() -> None:
    breaker, clock, _ = make(sliding_window_type="time", sliding_window_size=5, minimum_number_of_calls=100)
    for _ in range(5):
        succeed(breaker)
        clock.advance(1.0)
    assert breaker.metrics.calls == 4  # the first call (5 s ago) has left
    clock.advance(1_000_000.0)  # a long idle period is O(window), not O(gap)
    assert breaker.metrics.calls == 0
    succeed(breaker, 2)
    assert breaker.metrics.calls == 2


def test_slow_call_rate_opens_it() -> None:
    breaker, _, events = make(slow_call_rate_threshold=50.0, slow_call_duration=2.0)
    succeed(breaker, 2, duration=0.1)
    succeed(breaker, 1, duration=2.0)  # exactly the duration: slow
    assert breaker.metrics.slow_calls == 1
    assert state_of(breaker) is State.CLOSED
    succeed(breaker, 1, duration=3.0)  # 2 slow of 4 = 50 %
    assert state_of(breaker) is State.OPEN
    assert transitions(events) == [(State.CLOSED, State.OPEN)]


def test_a_slow_failure_counts_as_both() -> None:
    breaker, _, _ = make(minimum_number_of_calls=100, slow_call_duration=1.0)
    fail(breaker, 1, duration=1.5)
    m = breaker.metrics
    assert (m.calls, m.failures, m.slow_calls) == (1, 1, 1)


# -- OPEN ---------------------------------------------------------------------------------------------


def test_open_rejects_until_the_wait_elapses_then_half_opens() -> None:
    breaker, clock, events = make(wait_duration_in_open=30.0)
    trip(breaker)
    clock.advance(10.0)
    with pytest.raises(CircuitOpen) as info:
        breaker.acquire_permission()
    assert info.value.name == "test"
    assert info.value.state is State.OPEN
    assert info.value.retry_after == pytest.approx(20.0)
    assert breaker.metrics.not_permitted == 1
    clock.advance(20.0)
    assert state_of(breaker) is State.OPEN  # the transition happens on the next permission request
    breaker.acquire_permission()
    assert state_of(breaker) is State.HALF_OPEN
    assert transitions(events) == [(State.CLOSED, State.OPEN), (State.OPEN, State.HALF_OPEN)]


def test_an_open_circuit_refuses_every_permission_and_counts_it() -> None:
    breaker, _, _ = make()
    trip(breaker)
    for _ in range(1000):
        with pytest.raises(CircuitOpen):
            breaker.acquire_permission()
    assert breaker.metrics.not_permitted == 1000


# -- HALF_OPEN ----------------------------------------------------------------------------------------


def half_open(**overrides: Any) -> tuple[CircuitBreaker, FakeClock, list[Transition]]:
    breaker, clock, events = make(**overrides)
    trip(breaker)
    clock.advance(30.0)
    return breaker, clock, events


def test_half_open_permits_exactly_the_probe_calls() -> None:
    breaker, _, _ = half_open(permitted_calls_in_half_open=3)
    for _ in range(3):
        breaker.acquire_permission()
    assert state_of(breaker) is State.HALF_OPEN
    with pytest.raises(CircuitOpen) as info:
        breaker.acquire_permission()  # the (n+1)-th concurrent call
    assert info.value.state is State.HALF_OPEN
    assert breaker.metrics.not_permitted == 1
    breaker.on_success(0.1)  # one probe done: its permit is not handed out again
    with pytest.raises(CircuitOpen):
        breaker.acquire_permission()


def test_half_open_released_permit_can_be_reused() -> None:
    breaker, _, _ = half_open(permitted_calls_in_half_open=1)
    breaker.acquire_permission()
    with pytest.raises(CircuitOpen):
        breaker.acquire_permission()
    breaker.release_permission()  # e.g. the probe was cancelled
    breaker.acquire_permission()
    breaker.on_success(0.1)
    assert state_of(breaker) is State.CLOSED


def test_probes_succeeding_close_it_with_a_cleared_window() -> None:
    breaker, _, events = half_open(permitted_calls_in_half_open=2)
    breaker.acquire_permission()
    breaker.acquire_permission()
    breaker.on_success(0.1)
    assert state_of(breaker) is State.HALF_OPEN
    m = breaker.metrics
    assert (m.calls, m.failure_rate, m.state) == (1, -1.0, State.HALF_OPEN)
    breaker.on_error(0.1)  # 1 / 2 = 50 % ... at the threshold: reopens
    assert state_of(breaker) is State.OPEN
    assert transitions(events)[-1] == (State.HALF_OPEN, State.OPEN)


def test_probes_below_threshold_close() -> None:
    breaker, _, events = half_open(permitted_calls_in_half_open=2)
    succeed(breaker, 2)
    assert state_of(breaker) is State.CLOSED
    m = breaker.metrics
    assert (m.calls, m.failures) == (0, 0)
    assert transitions(events) == [
        (State.CLOSED, State.OPEN),
        (State.OPEN, State.HALF_OPEN),
        (State.HALF_OPEN, State.CLOSED),
    ]


def test_probes_failing_reopen_and_the_wait_restarts() -> None:
    breaker, clock, events = half_open(permitted_calls_in_half_open=2)
    fail(breaker, 2)
    assert state_of(breaker) is State.OPEN
    with pytest.raises(CircuitOpen) as info:
        breaker.acquire_permission()
    assert info.value.retry_after == pytest.approx(30.0)
    m = breaker.metrics  # OPEN shows the probes that reopened it
    assert (m.calls, m.failures, m.failure_rate, m.state) == (2, 2, 100.0, State.OPEN)
    clock.advance(30.0)
    breaker.acquire_permission()
    assert state_of(breaker) is State.HALF_OPEN
    assert transitions(events) == [
        (State.CLOSED, State.OPEN),
        (State.OPEN, State.HALF_OPEN),
        (State.HALF_OPEN, State.OPEN),
        (State.OPEN, State.HALF_OPEN),
    ]


def test_slow_probes_reopen() -> None:
    breaker, _, _ = half_open(permitted_calls_in_half_open=2, slow_call_duration=1.0)
    succeed(breaker, 2, duration=1.0)
    assert state_of(breaker) is State.OPEN


def test_max_wait_in_half_open_reopens() -> None:
    breaker, clock, events = half_open(permitted_calls_in_half_open=2, max_wait_in_half_open=5.0)
    breaker.acquire_permission()  # a probe that never completes
    clock.advance(4.9)
    assert state_of(breaker) is State.HALF_OPEN
    clock.advance(0.1)
    assert state_of(breaker) is State.OPEN
    assert transitions(events)[-1] == (State.HALF_OPEN, State.OPEN)
    with pytest.raises(CircuitOpen) as info:
        breaker.acquire_permission()
    assert info.value.retry_after == pytest.approx(30.0)


def test_without_max_wait_half_open_waits_for_its_probes() -> None:
    breaker, clock, _ = half_open(permitted_calls_in_half_open=1)
    breaker.acquire_permission()
    clock.advance(3600.0)
    assert state_of(breaker) is State.HALF_OPEN


# -- reset --------------------------------------------------------------------------------------------


def test_reset_clears_the_window() -> None:
    breaker, _, events = make()
    fail(breaker, 3)
    breaker.reset()
    assert breaker.metrics.calls == 0
    assert events == []  # already closed: no state change
    fail(breaker, 3)
    assert state_of(breaker) is State.CLOSED


def test_reset_closes_an_open_circuit() -> None:
    breaker, _, events = make()
    trip(breaker)
    with pytest.raises(CircuitOpen):
        breaker.acquire_permission()
    breaker.reset()
    assert state_of(breaker) is State.CLOSED
    assert breaker.metrics.not_permitted == 0
    assert transitions(events) == [(State.CLOSED, State.OPEN), (State.OPEN, State.CLOSED)]
    assert breaker.metrics.calls == 0
    breaker.acquire_permission()


def test_outcomes_arriving_while_open_are_not_recorded() -> None:
    breaker, _, _ = make()
    breaker.acquire_permission()  # a slow call permitted while CLOSED ...
    trip(breaker)
    before = breaker.metrics
    breaker.on_error(0.1)  # ... completes while OPEN
    assert breaker.metrics == before


# -- probes given back ---------------------------------------------------------------------------------


def test_a_probe_given_back_frees_its_permit_and_records_nothing() -> None:
    """A cancelled call (``release_permission``, as the clients do) says nothing about the server."""
    breaker, _, _ = half_open(permitted_calls_in_half_open=1)
    breaker.acquire_permission()
    with pytest.raises(CircuitOpen):
        breaker.acquire_permission()
    breaker.release_permission()
    assert breaker.metrics.calls == 0
    breaker.acquire_permission()  # the permit is available again


def test_threads_take_no_more_probe_permits_than_allowed() -> None:
    breaker, _, _ = half_open(permitted_calls_in_half_open=5)
    granted = 0
    rejected = 0
    guard = threading.Lock()
    barrier = threading.Barrier(32)

    def worker() -> None:
        nonlocal granted, rejected
        barrier.wait()
        try:
            breaker.acquire_permission()
        except CircuitOpen:
            with guard:
                rejected += 1
        else:
            with guard:
                granted += 1

    threads = [threading.Thread(target=worker) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (granted, rejected) == (5, 27)


def test_threads_record_every_outcome() -> None:
    breaker, _, _ = make(sliding_window_size=10_000, minimum_number_of_calls=10_000)

    def worker() -> None:
        succeed(breaker, 500)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert breaker.metrics.calls == 4000


# -- property: the count window against a naive model -------------------------------------------------

steps = st.lists(
    st.tuples(st.booleans(), st.sampled_from([0.0, 0.5, 2.0, 3.0]), st.floats(0.0, 10.0)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=steps,
    window=st.integers(1, 8),
    minimum=st.integers(1, 10),
    failure_threshold=st.sampled_from([25.0, 50.0, 75.0, 100.0]),
    slow_threshold=st.sampled_from([50.0, 100.0]),
)
def test_count_window_matches_a_naive_model(
    ops: list[tuple[bool, float, float]],
    window: int,
    minimum: int,
    failure_threshold: float,
    slow_threshold: float,
) -> None:
    clock = FakeClock()
    config = BreakerConfig(
        failure_rate_threshold=failure_threshold,
        slow_call_rate_threshold=slow_threshold,
        slow_call_duration=2.0,
        sliding_window_size=window,
        minimum_number_of_calls=minimum,
        wait_duration_in_open=1e9,  # never leaves OPEN within a test
    )
    breaker = CircuitBreaker(config, clock=clock)
    recorded: list[tuple[bool, bool]] = []  # (failed, slow) of every call recorded while CLOSED
    tripped = False

    def naive(calls: list[tuple[bool, bool]]) -> tuple[int, float, float]:
        last = calls[-window:]
        if len(last) < min(minimum, window):
            return len(last), -1.0, -1.0
        failures = sum(1 for f, _ in last if f)
        slow = sum(1 for _, s in last if s)
        return len(last), failures * 100.0 / len(last), slow * 100.0 / len(last)

    for failed, duration, advance in ops:
        clock.advance(advance)
        if tripped:
            with pytest.raises(CircuitOpen):
                breaker.acquire_permission()
            assert state_of(breaker) is State.OPEN
            continue
        breaker.acquire_permission()
        if failed:
            breaker.on_error(duration)
        else:
            breaker.on_success(duration)
        recorded.append((failed, duration >= 2.0))
        calls, failure_rate, slow_rate = naive(recorded)
        tripped = failure_rate >= failure_threshold or slow_rate >= slow_threshold
        m: BreakerMetrics = breaker.metrics
        assert m.calls == calls
        assert m.failure_rate == pytest.approx(failure_rate)
        assert m.slow_call_rate == pytest.approx(slow_rate)
        assert (state_of(breaker) is State.OPEN) == tripped
