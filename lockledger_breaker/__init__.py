"""A small circuit breaker with Resilience4j's semantics, for the SDK's clients (asyncio and threads) and
the server's database guard (``service/database_guard.py``).

Why hand-written: they need a failure rate over a count- *or* time-based sliding window with a
minimum number of calls, a slow-call rate and a limited number of half-open probe calls, and it must work
from asyncio and from threads. No Python breaker library offers all of
that: pybreaker and circuitbreaker count consecutive failures (no window, no slow calls), aiobreaker is
pybreaker for asyncio, purgatory has no slow-call rate and no half-open probe limit. This module is the
few hundred lines that fill that gap, with no I/O and only the standard library.

States: CLOSED -> OPEN when, with at least ``minimum_number_of_calls`` in the window, the failure rate or
the slow-call rate reaches its threshold; OPEN -> HALF_OPEN once ``wait_duration_in_open`` has elapsed
(checked when a call asks for permission); HALF_OPEN permits ``permitted_calls_in_half_open`` probes and,
once they have all completed, goes back to OPEN (rates at or above a threshold) or to CLOSED (window
cleared). ``reset()`` closes it with an empty window. Its users call ``acquire_permission()`` before each
call and report the outcome with ``on_success``, ``on_error`` or ``release_permission``; ``state`` and
``metrics`` show how it stands.

Thread safety: every state change happens under one ``threading.Lock`` held for a few field updates only,
never while a call runs or awaits.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = [
    "BreakerConfig",
    "BreakerMetrics",
    "CircuitBreaker",
    "CircuitOpen",
    "State",
]


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitOpen(Exception):
    """A call was not permitted by the breaker; raised at once, without calling anything."""

    def __init__(self, name: str, state: State, retry_after: float | None = None) -> None:
        super().__init__(name, state, retry_after)
        self.name = name
        self.state = state
        self.retry_after = retry_after

    def __str__(self) -> str:  # formatted lazily: rejection is the hot path while the circuit is open
        hint = f", retry after {self.retry_after:.3f}s" if self.retry_after is not None else ""
        return f"circuit breaker {self.name!r} is {self.state.value}: call not permitted{hint}"


@dataclass(frozen=True)
class BreakerConfig:
    failure_rate_threshold: float = 50.0  # percent
    slow_call_rate_threshold: float = 100.0  # percent
    slow_call_duration: float = 5.0
    sliding_window_type: Literal["count", "time"] = "count"
    sliding_window_size: int = 100  # calls (count) or seconds (time)
    minimum_number_of_calls: int = 10
    wait_duration_in_open: float = 30.0
    permitted_calls_in_half_open: int = 5
    max_wait_in_half_open: float = 0.0  # 0 = wait for the permitted probe calls to finish

    def __post_init__(self) -> None:
        if not 0.0 < self.failure_rate_threshold <= 100.0:
            raise ValueError("failure_rate_threshold must be in (0, 100]")
        if not 0.0 < self.slow_call_rate_threshold <= 100.0:
            raise ValueError("slow_call_rate_threshold must be in (0, 100]")
        if self.slow_call_duration <= 0.0:
            raise ValueError("slow_call_duration must be > 0")
        if self.sliding_window_type not in ("count", "time"):
            raise ValueError("sliding_window_type must be 'count' or 'time'")
        if self.sliding_window_size < 1:
            raise ValueError("sliding_window_size must be >= 1")
        if self.minimum_number_of_calls < 1:
            raise ValueError("minimum_number_of_calls must be >= 1")
        if self.wait_duration_in_open < 0.0:
            raise ValueError("wait_duration_in_open must be >= 0")
        if self.permitted_calls_in_half_open < 1:
            raise ValueError("permitted_calls_in_half_open must be >= 1")
        if self.max_wait_in_half_open < 0.0:
            raise ValueError("max_wait_in_half_open must be >= 0")


@dataclass(frozen=True)
class BreakerMetrics:
    calls: int
    failures: int
    slow_calls: int
    not_permitted: int
    failure_rate: float  # percent over the window, -1.0 while fewer than minimum_number_of_calls
    slow_call_rate: float  # idem
    state: State


_FAILED = 1
_SLOW = 2


class _CountWindow:
    """The last ``size`` calls, in a ring buffer of outcome bits; O(1) per call."""

    def __init__(self, size: int) -> None:
        self._ring = [0] * size
        self._next = 0
        self.calls = 0
        self.failures = 0
        self.slow = 0

    def record(self, now: float, outcome: int) -> None:
        old = self._ring[self._next]
        if self.calls == len(self._ring):
            self.failures -= old & _FAILED
            self.slow -= (old & _SLOW) >> 1
        else:
            self.calls += 1
        self._ring[self._next] = outcome
        self._next = (self._next + 1) % len(self._ring)
        self.failures += outcome & _FAILED
        self.slow += (outcome & _SLOW) >> 1

    def advance(self, now: float) -> None:
        pass


class _TimeWindow:
    """Calls in the last ``size`` seconds, in per-second buckets; O(1) amortized per call."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._calls = [0] * size
        self._failures = [0] * size
        self._slow = [0] * size
        self._head: int | None = None  # the latest epoch second seen
        self.calls = 0
        self.failures = 0
        self.slow = 0

    def advance(self, now: float) -> None:
        sec = math.floor(now)
        if self._head is None:
            self._head = sec
            return
        if sec <= self._head:
            return
        # Clear the buckets of seconds head+1 .. sec (they hold seconds that left the window).
        for s in range(max(self._head + 1, sec - self._size + 1), sec + 1):
            i = s % self._size
            self.calls -= self._calls[i]
            self.failures -= self._failures[i]
            self.slow -= self._slow[i]
            self._calls[i] = self._failures[i] = self._slow[i] = 0
        self._head = sec

    def record(self, now: float, outcome: int) -> None:
        self.advance(now)
        assert self._head is not None
        i = self._head % self._size
        failed, slow = outcome & _FAILED, (outcome & _SLOW) >> 1
        self._calls[i] += 1
        self._failures[i] += failed
        self._slow[i] += slow
        self.calls += 1
        self.failures += failed
        self.slow += slow


_Window: TypeAlias = _CountWindow | _TimeWindow


def _rate(part: int, calls: int, minimum: int) -> float:
    if calls < minimum or calls == 0:
        return -1.0
    return part * 100.0 / calls


class CircuitBreaker:
    def __init__(
        self,
        config: BreakerConfig | None = None,
        *,
        name: str = "lockledger",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config if config is not None else BreakerConfig()
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._state = State.CLOSED
        self._window: _Window = self._new_window()  # CLOSED's window; in OPEN, the one that tripped it
        self._window_minimum = self._minimum()
        self._not_permitted = 0
        self._opened_at = 0.0
        self._half_open_at = 0.0
        self._permits_taken = 0  # HALF_OPEN: probe permits handed out and not yet given back
        self._probes: _CountWindow = _CountWindow(self.config.permitted_calls_in_half_open)

    # -- internals (all called with self._lock held) -----------------------------------------------

    def _new_window(self) -> _Window:
        if self.config.sliding_window_type == "time":
            return _TimeWindow(self.config.sliding_window_size)
        return _CountWindow(self.config.sliding_window_size)

    def _minimum(self) -> int:
        if self.config.sliding_window_type == "count":
            return min(self.config.minimum_number_of_calls, self.config.sliding_window_size)
        return self.config.minimum_number_of_calls

    def _transition(self, to: State, now: float) -> None:
        if to is State.OPEN:
            self._opened_at = now
            if self._state is State.HALF_OPEN:  # OPEN shows the calls that opened it
                self._window = self._probes
                self._window_minimum = self.config.permitted_calls_in_half_open
        elif to is State.HALF_OPEN:
            self._half_open_at = now
            self._permits_taken = 0
            self._probes = _CountWindow(self.config.permitted_calls_in_half_open)
        elif to is State.CLOSED:
            self._window = self._new_window()
            self._window_minimum = self._minimum()
        self._state = to

    def _check_half_open_timeout(self, now: float) -> None:
        limit = self.config.max_wait_in_half_open
        if self._state is State.HALF_OPEN and limit > 0.0 and now - self._half_open_at >= limit:
            self._transition(State.OPEN, now)

    def _exceeds(self, calls: int, failures: int, slow: int, minimum: int) -> bool:
        if calls < minimum or calls == 0:
            return False
        return (
            failures * 100.0 / calls >= self.config.failure_rate_threshold
            or slow * 100.0 / calls >= self.config.slow_call_rate_threshold
        )

    def _record(self, duration_s: float, failed: bool) -> None:
        slow = duration_s >= self.config.slow_call_duration
        outcome = (_FAILED if failed else 0) | (_SLOW if slow else 0)
        with self._lock:
            now = self._clock()
            self._check_half_open_timeout(now)
            if self._state is State.CLOSED:
                w = self._window
                w.record(now, outcome)
                if self._exceeds(w.calls, w.failures, w.slow, self._window_minimum):
                    self._transition(State.OPEN, now)
            elif self._state is State.HALF_OPEN:
                p = self._probes
                p.record(now, outcome)
                self._permits_taken = max(0, self._permits_taken - 1)
                n = self.config.permitted_calls_in_half_open
                if p.calls >= n:
                    to = State.OPEN if self._exceeds(p.calls, p.failures, p.slow, n) else State.CLOSED
                    self._transition(to, now)
            # OPEN: late outcomes of earlier calls are not recorded.

    # -- public API ---------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        with self._lock:
            self._check_half_open_timeout(self._clock())
            return self._state

    def acquire_permission(self) -> None:
        """Return if a call may proceed, else raise `CircuitOpen` (and count it as not permitted)."""
        with self._lock:
            state = self._state
            if state is State.CLOSED:
                return
            now = self._clock()
            if state is State.OPEN:
                remaining = self._opened_at + self.config.wait_duration_in_open - now
                if remaining > 0.0:
                    self._not_permitted += 1
                    raise CircuitOpen(self.name, state, remaining)
                self._transition(State.HALF_OPEN, now)
            else:  # HALF_OPEN, unless its probes took longer than max_wait_in_half_open
                self._check_half_open_timeout(now)
            error: CircuitOpen | None = None
            if self._state is State.HALF_OPEN and (
                self._permits_taken < self.config.permitted_calls_in_half_open - self._probes.calls
            ):
                self._permits_taken += 1
            else:
                self._not_permitted += 1
                retry = self.config.wait_duration_in_open if self._state is State.OPEN else None
                error = CircuitOpen(self.name, self._state, retry)
        if error is not None:
            raise error

    def on_success(self, duration_s: float) -> None:
        self._record(duration_s, failed=False)

    def on_error(self, duration_s: float) -> None:
        self._record(duration_s, failed=True)

    def release_permission(self) -> None:
        """Give back the permission of a call that counts neither as success nor as error."""
        with self._lock:
            if self._state is State.HALF_OPEN and self._permits_taken > 0:
                self._permits_taken -= 1

    def reset(self) -> None:
        """Back to CLOSED with an empty window and a zero not-permitted counter."""
        with self._lock:
            self._not_permitted = 0
            self._transition(State.CLOSED, self._clock())

    @property
    def metrics(self) -> BreakerMetrics:
        """Counters over the current window: CLOSED's sliding window, the probe calls while HALF_OPEN, and
        in OPEN the window whose rates opened it. ``not_permitted`` counts since creation or `reset()`.
        """
        with self._lock:
            now = self._clock()
            if self._state is State.HALF_OPEN:
                w: _Window = self._probes
                minimum = self.config.permitted_calls_in_half_open
            else:
                w = self._window
                w.advance(now)
                minimum = self._window_minimum
            return BreakerMetrics(
                calls=w.calls,
                failures=w.failures,
                slow_calls=w.slow,
                not_permitted=self._not_permitted,
                failure_rate=_rate(w.failures, w.calls, minimum),
                slow_call_rate=_rate(w.slow, w.calls, minimum),
                state=self._state,
            )
