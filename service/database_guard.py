"""Failing fast while PostgreSQL is unreachable.

Without a guard, every command would wait out its full timeout while the database is frozen or down,
holding a request, a pool slot and a client's patience each. The guard is a circuit breaker (the same
one the SDK uses, ``lockledger_breaker``) around every database round trip of the command path: once
enough round trips time out or lose their connection it opens, and commands fail at once with 503
``unavailable`` and ``Retry-After`` until a few probe round trips succeed again. Conflicts inside a batch
(a key taken concurrently, a deadlock) say nothing about the database's health and do not count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg

from lockledger_breaker import BreakerConfig, CircuitBreaker, CircuitOpen
from service.errors import Unavailable

T = TypeVar("T")

# No writable primary behind this session: the server is shutting down or restarting (a failover demotes
# the old primary by restarting it), or it takes no writes (a standby now). The pool then drops every
# connection, so the next ones go where a multi-host URL's ``target_session_attrs=read-write`` finds one.
NOT_PRIMARY = (
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.ReadOnlySQLTransactionError,
)

UNREACHABLE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.QueryCanceledError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.InternalClientError,  # a connection left mid-operation by a cut-off round trip
    *NOT_PRIMARY,
)


# The refusals the guard answers without a round trip: the stall watchdog's and the open breaker's.
STALLED = "the database has stopped answering; retry shortly"
NOT_TRIED = (
    "the database is not answering (recent round trips failed, so this one was not tried); retry shortly"
)


def is_unreachable(error: BaseException) -> bool:
    """Whether an error says the database cannot be reached in time (rather than refused a statement)."""
    return isinstance(error, UNREACHABLE)


class DatabaseGuard:
    """The breaker, plus a stall watchdog: a round trip still outstanding ``stall_s`` after it began (the
    command timeout, by which it should have been cancelled) means the server does not even answer the
    cancel, as when it is frozen. The breaker would notice only once such calls give up (asyncpg then
    waits for the cancel too, so twice the timeout) and fill its window; meanwhile every new request would
    queue behind them. So while a call has stalled, new ones fail at once with 503."""

    def __init__(self, config: BreakerConfig | None = None, *, stall_s: float | None = None) -> None:
        self._stall_s = stall_s
        self._in_flight: dict[int, float] = {}  # call number -> start; insertion order, so oldest first
        self._calls = 0
        self.breaker = CircuitBreaker(
            config
            or BreakerConfig(
                failure_rate_threshold=50.0,
                sliding_window_type="count",
                sliding_window_size=20,
                minimum_number_of_calls=4,
                wait_duration_in_open=2.0,
                permitted_calls_in_half_open=2,
            ),
            name="database",
        )

    def stalled_for(self) -> float:
        """How long the oldest outstanding round trip has run past ``stall_s`` (0 when none has)."""
        if self._stall_s is None or not self._in_flight:
            return 0.0
        return max(0.0, time.monotonic() - next(iter(self._in_flight.values())) - self._stall_s)

    def refuse_if_stalled(self) -> None:
        """503 at once while a round trip has stalled (checked by ``run``, and by the command path before
        a request queues for a round trip)."""
        if self.stalled_for() > 0:
            raise Unavailable(STALLED, 1)

    async def run(self, work: Callable[[], Awaitable[T]]) -> T:
        self.refuse_if_stalled()
        try:
            self.breaker.acquire_permission()
        except CircuitOpen as error:
            retry_after = math.ceil(error.retry_after) if error.retry_after else 1
            raise Unavailable(NOT_TRIED, max(retry_after, 1)) from error
        started = time.monotonic()
        self._calls += 1
        call = self._calls
        self._in_flight[call] = started
        try:
            result = await work()
        except BaseException as error:
            if is_unreachable(error):
                self.breaker.on_error(time.monotonic() - started)
            elif isinstance(error, Exception):
                self.breaker.on_success(time.monotonic() - started)
            else:
                self.breaker.release_permission()
            raise
        finally:
            del self._in_flight[call]
        self.breaker.on_success(time.monotonic() - started)
        return result
