"""The asynchronous projector: a table kept from the log, a page at a time, behind a checkpoint.

Reading is the change feed's (``eventstore/tail.py``): windows of transaction ids below the snapshot's
xmin, so an event committed late is never skipped. Each step applies one page of the open window and
moves the checkpoint (``projections/checkpoints.py``) in the same transaction, and only from the
checkpoint it read: a crash before the commit leaves both as they were, and a page is never applied twice
on top of a moved checkpoint. Projections are also idempotent, so even that would change nothing.

``covered_until`` comes from marks: before opening a window the projector takes a transaction id ``V`` of
its own, with the statement's start time ``c``. A writer takes its transaction id no later than the
statement that reads the clock for ``recorded_at``, which the server bounds by ``statement_timeout``; so
every event recorded at or before ``c - SETTLE`` belongs to a transaction below ``V``, and once a window
reaching past ``V`` is applied, so is every such event.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from eventstore.connection import Connection
from eventstore.tail import EventKey, Tail, read_keys
from projections import checkpoints
from projections.checkpoints import Checkpoint

SETTLE = timedelta(seconds=5)  # the service role's default statement_timeout (service/config.py)
_MARK_SQL = "SELECT statement_timestamp() AS at, pg_current_xact_id()::text::bigint AS tx"
_FIRST_TX = 1  # a checkpoint at (1, 1): nothing applied, the whole log to read


@dataclass(frozen=True, slots=True)
class Projection:
    """What a projector keeps: its table (and checkpoint) name, how a page of events is applied to a
    table of that shape, and how such a table is built from every transaction below an xmin."""

    name: str
    apply: Callable[[Connection, str, list[EventKey]], Awaitable[None]]
    build: Callable[[Connection, str, int], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Step:
    applied: int  # events applied by this step
    caught_up: bool  # the window read was the last one open: nothing committed before it is left
    delays: list[float] = field(default_factory=list)  # per event: seconds from recorded to applied


class CheckpointMissing(RuntimeError):
    """The projector's table has no checkpoint (migrations not run, or a rebuild not begun)."""


def initial_checkpoint(name: str) -> Checkpoint:
    return Checkpoint(name, _FIRST_TX, _FIRST_TX, 0, None)


class Projector:
    """One projection kept in one table (its own, or a rebuild's shadow)."""

    def __init__(
        self,
        projection: Projection,
        *,
        table: str | None = None,
        page: int = 2_000,
        settle: timedelta = SETTLE,
    ) -> None:
        self.projection = projection
        self.table = table or projection.name
        self._page = page
        self._settle = settle  # the writers' statement_timeout
        self._tail = Tail()
        self._checkpoint: Checkpoint | None = None
        self._marks: deque[tuple[int, datetime]] = deque()
        self._opened_at = time.monotonic()  # when the open window's snapshot was taken
        self.current_at: float | None = None  # monotonic time of the snapshot last applied in full
        self._window_floor: tuple[int, int] | None = None  # (lo, a position below its transactions' events)

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self._checkpoint

    def lag_s(self) -> float | None:
        """Seconds since the snapshot whose committed events are all applied (None: not once yet)."""
        return None if self.current_at is None else time.monotonic() - self.current_at

    async def step(self, conn: Connection) -> Step:
        """Apply the next page of the open window, opening the next window first when none is open."""
        cp = self._checkpoint or await checkpoints.load(conn, self.table)
        if cp is None:
            raise CheckpointMissing(self.table)
        lo, hi, after = cp.lo, cp.hi, cp.after
        if lo == hi:
            mark = await self._mark(conn)
            self._tail.boundary = lo
            window = await self._tail.poll(conn, wanted=lambda: False)
            if window is None:
                self._checkpoint = cp
                self.current_at = time.monotonic()
                return Step(0, caught_up=True)
            self._marks.append(mark)
            self._opened_at = time.monotonic()
            hi, after = window.hi, max(after, self._tail.floor(lo))
            self._window_floor = (lo, after)
        events = await read_keys(conn, lo, hi, after=after, page=self._page)
        done = len(events) < self._page
        new = Checkpoint(
            self.table,
            hi if done else lo,
            hi,
            self._floor_after(lo, hi) if done else events[-1].position,
            self._covered(hi) if done else None,
        )
        async with conn.transaction():
            applied_at = await checkpoints.advance(conn, cp, new)
            if applied_at is None:  # moved under us (another runner, a rebuild's switch): read it again
                self._checkpoint = None
                return Step(0, caught_up=False)
            await self.projection.apply(conn, self.table, events)
        self._checkpoint = new
        if done:
            self.current_at = self._opened_at
        return Step(len(events), caught_up=done, delays=_delays(events, applied_at))

    def _floor_after(self, lo: int, hi: int) -> int:
        """A position below every event of the transactions from ``hi`` on, once ``[lo, hi)`` is applied.
        The floor the window was opened with holds for them too (they are among those from ``lo``): the
        tail's own floor is 0 until its first marks, and a 0 would have the next window read the whole
        log."""
        opened = self._window_floor[1] if self._window_floor and self._window_floor[0] == lo else 0
        return max(opened, self._tail.floor(hi))

    async def catch_up(self, conn: Connection) -> int:
        """Step until a window is applied in full; the events applied."""
        total = 0
        while not (step := await self.step(conn)).caught_up:
            total += step.applied
        return total + step.applied

    async def _mark(self, conn: Connection) -> tuple[int, datetime]:
        async with conn.transaction():
            await conn.execute("SET LOCAL synchronous_commit TO off")  # a lost mark is never used
            row = await conn.fetchrow(_MARK_SQL)
        assert row is not None
        return row["tx"], row["at"]

    def _covered(self, hi: int) -> datetime | None:
        """The latest ``c - settle`` of the marks below ``hi``, which a window up to ``hi`` covers."""
        covered = None
        while self._marks and self._marks[0][0] < hi:
            covered = self._marks.popleft()[1] - self._settle
        return covered


async def build(
    conn: Connection, projection: Projection, table: str | None = None, *, floor: int = 0
) -> Checkpoint:
    """Fill ``table`` (the projection's own by default, empty) from every transaction below the current
    xmin in one snapshot, and set its checkpoint there: a projector takes over from it. ``floor`` is a
    position below every event of a transaction not yet ended, when the caller knows one (a loader alone
    on its database: the last position); 0 makes the projector's first window read from the start."""
    table = table or projection.name
    tx, at = await Projector(projection, table=table)._mark(conn)
    async with conn.transaction(isolation="repeatable_read"):
        xmin: int = await conn.fetchval("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
        await projection.build(conn, table, xmin)
        built = Checkpoint(table, xmin, xmin, floor, at - SETTLE if tx < xmin else None)
        await checkpoints.store(conn, built)
    return built


def _delays(events: list[EventKey], applied_at: datetime) -> list[float]:
    return [(applied_at - e.recorded_at).total_seconds() for e in events]


def versions(events: list[EventKey]) -> list[tuple[str, int]]:
    """The (stream, version) of each event."""
    return [(e.stream, e.version) for e in events]
