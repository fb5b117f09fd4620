"""The SDK's circuit breaker (lockledger_breaker), driven by a fake clock."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockledger_breaker import (
    BreakerConfig,
    BreakerMetrics,
    CircuitBreaker,
    CircuitOpen,
    State,
    StateChange,
)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(
    clock: FakeClock | None = None, **overrides: object
) -> tuple[CircuitBreaker, FakeClock, list[StateChange]]:
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
    breaker = CircuitBreaker(BreakerConfig(**base), name="test", clock=clock)  # type: ignore[arg-type]
    events: list[StateChange] = []
    breaker.add_listener(events.append)
    return breaker, clock, events


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


def transitions(events: list[StateChange]) -> list[tuple[State, State]]:
    return [(e.from_state, e.to_state) for e in events]


# -- states and values --------------------------------------------------------------------------------


def test_state_values_are_lowercase_names() -> None:
    assert [s.value for s in State] == ["closed", "open", "half_open", "forced_open", "disabled"]


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
    assert events[0].name == "test"


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


def test_circuit_open_is_raised_without_calling_fn() -> None:
    breaker, _, _ = make()
    trip(breaker)
    called = 0

    def fn() -> int:
        nonlocal called
        called += 1
        return 1

    for _ in range(1000):
        with pytest.raises(CircuitOpen):
            breaker.call_sync(fn)
    assert called == 0
    assert breaker.metrics.not_permitted == 1000


def test_rejection_never_suspends() -> None:
    """An open circuit answers within the caller's own step: the coroutine raises on its first
    ``send`` without yielding to the event loop, so no I/O (and no network call) can be awaited."""
    breaker, _, _ = make()
    trip(breaker)
    awaited = False

    async def fn() -> int:
        nonlocal awaited
        awaited = True
        return 1

    for _ in range(100):
        step = breaker.call(fn)
        with pytest.raises(CircuitOpen):
            step.send(None)
        step.close()
    assert not awaited
    assert breaker.metrics.not_permitted == 100


async def test_async_call_rejected_without_awaiting_fn() -> None:
    breaker, _, _ = make()
    breaker.force_open()
    called = False

    async def fn() -> int:
        nonlocal called
        called = True
        return 1

    with pytest.raises(CircuitOpen) as info:
        await breaker.call(fn)
    assert info.value.state is State.FORCED_OPEN
    assert info.value.retry_after is None
    assert not called


# -- HALF_OPEN ----------------------------------------------------------------------------------------


def half_open(**overrides: Any) -> tuple[CircuitBreaker, FakeClock, list[StateChange]]:
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


# -- FORCED_OPEN, DISABLED, reset ---------------------------------------------------------------------


def test_force_open_rejects_everything_until_reset() -> None:
    breaker, clock, events = make()
    breaker.force_open()
    clock.advance(1e6)
    for _ in range(3):
        with pytest.raises(CircuitOpen):
            breaker.acquire_permission()
    assert state_of(breaker) is State.FORCED_OPEN
    assert breaker.metrics.not_permitted == 3
    breaker.reset()
    assert state_of(breaker) is State.CLOSED
    assert breaker.metrics.not_permitted == 0
    breaker.acquire_permission()
    assert transitions(events) == [(State.CLOSED, State.FORCED_OPEN), (State.FORCED_OPEN, State.CLOSED)]


def test_disabled_permits_everything_and_records_nothing() -> None:
    breaker, _, events = make()
    breaker.disable()
    fail(breaker, 50)
    assert state_of(breaker) is State.DISABLED
    m = breaker.metrics
    assert (m.calls, m.failures, m.not_permitted, m.state) == (0, 0, 0, State.DISABLED)
    breaker.transition_to_closed()
    assert state_of(breaker) is State.CLOSED
    assert transitions(events) == [(State.CLOSED, State.DISABLED), (State.DISABLED, State.CLOSED)]


def test_reset_clears_the_window() -> None:
    breaker, _, events = make()
    fail(breaker, 3)
    breaker.reset()
    assert breaker.metrics.calls == 0
    assert events == []  # already closed: no state change
    fail(breaker, 3)
    assert state_of(breaker) is State.CLOSED


def test_transition_to_closed_from_open() -> None:
    breaker, _, _ = make()
    trip(breaker)
    breaker.transition_to_closed()
    assert state_of(breaker) is State.CLOSED
    assert breaker.metrics.calls == 0
    breaker.acquire_permission()


def test_outcomes_arriving_while_open_are_not_recorded() -> None:
    breaker, _, _ = make()
    breaker.acquire_permission()  # a slow call permitted while CLOSED ...
    trip(breaker)
    before = breaker.metrics
    breaker.on_error(0.1)  # ... completes while OPEN
    assert breaker.metrics == before


# -- listeners ----------------------------------------------------------------------------------------


def test_listeners_get_each_state_change_and_their_errors_are_swallowed() -> None:
    breaker, clock, events = make()
    second: list[StateChange] = []

    def broken(change: StateChange) -> None:
        raise RuntimeError("listener bug")

    breaker.add_listener(broken)
    breaker.add_listener(second.append)
    trip(breaker)
    clock.advance(30.0)
    succeed(breaker, 2)
    breaker.force_open()
    breaker.disable()
    breaker.reset()
    expected = [
        (State.CLOSED, State.OPEN),
        (State.OPEN, State.HALF_OPEN),
        (State.HALF_OPEN, State.CLOSED),
        (State.CLOSED, State.FORCED_OPEN),
        (State.FORCED_OPEN, State.DISABLED),
        (State.DISABLED, State.CLOSED),
    ]
    assert transitions(events) == expected
    assert second == events
    assert events[1].at == clock.now
    assert all(e.name == "test" for e in events)


# -- call() and call_sync() ---------------------------------------------------------------------------


class Boom(Exception):
    pass


class NotFound(Exception):
    pass


def domain_errors_are_not_failures(exc: BaseException) -> bool:
    return not isinstance(exc, NotFound)


async def test_async_call_records_success_error_and_classification() -> None:
    clock = FakeClock()
    breaker, _, _ = make(clock, minimum_number_of_calls=100, slow_call_duration=1.0)

    async def ok() -> str:
        clock.advance(1.5)  # slow
        return "ok"

    async def boom() -> str:
        raise Boom

    async def not_found() -> str:
        raise NotFound

    assert await breaker.call(ok) == "ok"
    with pytest.raises(Boom):
        await breaker.call(boom)
    with pytest.raises(NotFound):
        await breaker.call(not_found, is_failure=domain_errors_are_not_failures)
    with pytest.raises(Boom):
        await breaker.call(boom, is_failure=domain_errors_are_not_failures)
    m = breaker.metrics
    assert (m.calls, m.failures, m.slow_calls) == (4, 2, 1)


async def test_async_call_trips_the_breaker() -> None:
    breaker, _, _ = make()

    async def boom() -> None:
        raise Boom

    for _ in range(4):
        with pytest.raises(Boom):
            await breaker.call(boom)
    with pytest.raises(CircuitOpen):
        await breaker.call(boom)


async def test_cancelled_probe_gives_its_permit_back() -> None:
    breaker, _, _ = half_open(permitted_calls_in_half_open=1)
    started = asyncio.Event()

    async def hang() -> None:
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(breaker.call(hang))
    await started.wait()
    with pytest.raises(CircuitOpen):
        breaker.acquire_permission()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker.metrics.calls == 0
    breaker.acquire_permission()  # the permit is available again


def test_call_sync_records_success_error_and_classification() -> None:
    clock = FakeClock()
    breaker, _, _ = make(clock, minimum_number_of_calls=100, slow_call_duration=1.0)

    def ok() -> int:
        clock.advance(2.0)
        return 42

    def raiser(exc: Exception) -> Callable[[], int]:
        def fn() -> int:
            raise exc

        return fn

    assert breaker.call_sync(ok) == 42
    with pytest.raises(Boom):
        breaker.call_sync(raiser(Boom()))
    with pytest.raises(NotFound):
        breaker.call_sync(raiser(NotFound()), is_failure=domain_errors_are_not_failures)
    m = breaker.metrics
    assert (m.calls, m.failures, m.slow_calls) == (3, 1, 1)


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
        for _ in range(500):
            breaker.call_sync(lambda: None)

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
