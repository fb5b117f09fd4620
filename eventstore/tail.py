"""Tailing the log without skipping late commits: windows of transaction ids below the snapshot's xmin.

Positions are drawn when a row is inserted, not when its transaction commits, so a transaction that commits
late shows an event whose position is lower than events already visible: a reader that remembers "the last
position I saw" skips it. Transaction ids do not have that problem once bounded by the snapshot's xmin:
every transaction with ``tx_id < pg_snapshot_xmin(pg_current_snapshot())`` has ended, so the set of
committed events below that boundary never changes again.

The reader therefore keeps a *boundary* (an xmin it has read up to) and, each poll, reads the *window*
``[boundary, xmin)`` of the new snapshot: every event of those transactions, in position order. Windows
are contiguous and disjoint, so each committed event falls in exactly one of them.

The ``events`` table has no index on ``tx_id``; each read is bounded below by a position *floor* from the
reader's own history. Each poll first takes a transaction id ``V`` of its own (``pg_current_xact_id()``,
committed at once): every id above ``V`` is assigned later, so every event of such a transaction draws its
position after the largest position the *previous* poll saw. (A snapshot's ``xmax`` cannot serve: it is
the latest *completed* id plus one, and running transactions may hold ids above it.) The previous poll,
not this one, gives the margin for a row whose position is drawn a moment before its transaction's id,
in the same INSERT. Where ids cannot be taken (a hot standby as read pool) or the history does not reach
back far enough, the floor is 0: correct, a full scan.

A subscriber's place in the feed is a *cursor* ``(position, lo, hi)``: it has every event of transactions
below ``lo``, those of ``[lo, hi)`` up to ``position``, none at or above ``hi``. Its text form is the SSE id
``<position>.<lo>.<hi>``.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from eventstore.connection import Connection
from eventstore.payloads import timestamp_text_sql

# The snapshot's xmin and the largest position visible in it, in one statement (one snapshot).
SNAPSHOT_SQL = """
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin,
       (SELECT coalesce(max(position), 0) FROM events) AS top
"""
# A transaction id of the reader's own, its statement its whole transaction: every later id is above it.
MARK_SQL = "SELECT pg_current_xact_id()::text::bigint"

# The events of transactions in [$2, $3) after position $1, filtered, in position order: one page.
WINDOW_SQL = f"""
SELECT position, tx_id::text::bigint AS tx, stream_id, event_type, data ->> 'owner' AS owner,
       data ->> 'from_owner' AS giver, metadata ->> 'saga_id' AS saga_id,
       json_build_object(
         'position', position, 'stream', stream_id, 'version', stream_version, 'event_id', event_id,
         'type', event_type, 'data', data, 'metadata', metadata,
         'recorded_at', {timestamp_text_sql("recorded_at")},
         'hash', encode(hash, 'hex'))::text AS line
  FROM events
 WHERE position > $1 AND tx_id >= $2::text::xid8 AND tx_id < $3::text::xid8
   AND ($4::text IS NULL OR starts_with(stream_id, $4))
   AND ($5::text IS NULL OR data ->> 'owner' = $5 OR data ->> 'from_owner' = $5)
   AND ($6::text IS NULL OR event_type = $6)
   AND ($7::text IS NULL OR stream_id = 'saga/' || $7 OR metadata ->> 'saga_id' = $7)
 ORDER BY position
 LIMIT $8
"""

# The same window, unfiltered, with only what a projector keys on: no export line to build and parse.
KEYS_SQL = """
SELECT position, stream_id, stream_version, recorded_at
  FROM events
 WHERE position > $1 AND tx_id >= $2::text::xid8 AND tx_id < $3::text::xid8
 ORDER BY position
 LIMIT $4
"""

CURSOR_PATTERN = r"^\d{1,19}(\.\d{1,19}\.\d{1,19})?$"
_CURSOR_RE = re.compile(CURSOR_PATTERN)
MARK_EVERY = 10  # polls per id taken for the history (about one a second)
HISTORY_LIMIT = 4096  # snapshots remembered for floors; dropping one only lowers a floor (slower, safe)


@dataclass(frozen=True, slots=True)
class Filter:
    prefix: str | None = None
    owner: str | None = None
    type: str | None = None
    saga: str | None = None

    def matches(self, event: TailEvent) -> bool:
        return (
            (self.prefix is None or event.stream.startswith(self.prefix))
            and (self.owner is None or self.owner in (event.owner, event.giver))
            and (self.type is None or event.type == self.type)
            and (self.saga is None or event.stream == f"saga/{self.saga}" or event.saga_id == self.saga)
        )


@dataclass(frozen=True, slots=True)
class TailEvent:
    position: int
    tx: int
    stream: str
    type: str
    owner: str | None
    giver: str | None  # a hand-off's from_owner: an owner filter matches the giver too
    saga_id: str | None
    line: str  # the NDJSON export line's object, as PostgreSQL wrote it


@dataclass(frozen=True, slots=True)
class Cursor:
    """Everything below ``lo`` seen, ``[lo, hi)`` seen up to ``position``, nothing from ``hi`` on."""

    position: int
    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.position}.{self.lo}.{self.hi}"


@dataclass(frozen=True, slots=True)
class Window:
    lo: int
    hi: int
    events: list[TailEvent]


def parse_cursor(text: str) -> tuple[int, Cursor | None]:
    """``(position, cursor)`` of an SSE id: a plain position (no boundary known, cursor None) or
    ``<position>.<lo>.<hi>``. ``ValueError`` for anything else."""
    text = text.strip()
    if not _CURSOR_RE.fullmatch(text):
        raise ValueError(f"not a feed position: {text[:40]!r}")
    parts = [int(part) for part in text.split(".")]
    if any(part >= 2**63 for part in parts):
        raise ValueError("out of range")
    if len(parts) == 1:
        return parts[0], None
    position, lo, hi = parts
    if lo > hi:
        raise ValueError("lo above hi")
    return position, Cursor(position, lo, hi)


def _event(r: Any) -> TailEvent:
    return TailEvent(
        r["position"],
        r["tx"],
        r["stream_id"],
        r["event_type"],
        r["owner"],
        r["giver"],
        r["saga_id"],
        r["line"],
    )


async def read_page(
    conn: Connection, lo: int, hi: int, *, after: int, flt: Filter = Filter(), page: int = 500
) -> list[TailEvent]:
    """Up to ``page`` events of transactions in ``[lo, hi)`` after position ``after``, in position order."""
    if lo >= hi:
        return []
    rows = await conn.fetch(
        WINDOW_SQL, after, str(lo), str(hi), flt.prefix, flt.owner, flt.type, flt.saga, page
    )
    return [_event(row) for row in rows]


@dataclass(frozen=True, slots=True)
class EventKey:
    """An event as a projector reads it: where it is in the log and in its stream, and when."""

    position: int
    stream: str
    version: int
    recorded_at: datetime


async def read_keys(conn: Connection, lo: int, hi: int, *, after: int, page: int = 500) -> list[EventKey]:
    """:func:`read_page`'s events, unfiltered, as :class:`EventKey`."""
    if lo >= hi:
        return []
    rows = await conn.fetch(KEYS_SQL, after, str(lo), str(hi), page)
    return [EventKey(r["position"], r["stream_id"], r["stream_version"], r["recorded_at"]) for r in rows]


async def read_range(
    conn: Connection, lo: int, hi: int, *, after: int, flt: Filter = Filter(), page: int = 500
) -> AsyncIterator[list[TailEvent]]:
    """Pages of the events of transactions in ``[lo, hi)`` after position ``after``, in position order.
    Only for ``hi`` at or below an xmin already read: that set no longer changes, so paging by position
    is exact."""
    while lo < hi:
        rows = await conn.fetch(
            WINDOW_SQL, after, str(lo), str(hi), flt.prefix, flt.owner, flt.type, flt.saga, page
        )
        if not rows:
            return
        events = [_event(row) for row in rows]
        yield events
        if len(rows) < page:
            return
        after = events[-1].position


class Tail:
    """The window logic of one reader: its boundary and the history its position floors come from."""

    def __init__(self) -> None:
        self.boundary: int | None = None  # every transaction below it has been read
        # (m, top): every transaction id >= m was assigned after ``top`` was the largest visible position.
        self._history: deque[tuple[int, int]] = deque()
        self._last_top: int | None = None
        self._marks = True  # False once the database refused an id (a hot standby)
        self._polls = 0

    def floor(self, lo: int) -> int:
        """A position below every event of a transaction ``>= lo`` (0 when the history cannot tell)."""
        found = 0
        for mark, top in self._history:
            if mark > lo:
                break
            found = top
        return found

    async def _mark(self, conn: Connection) -> int | None:
        """An id of the reader's own, once per ``MARK_EVERY`` polls (its commit need not wait for the
        disk: a mark lost in a crash is never used)."""
        self._polls += 1
        if not self._marks or (self._polls - 1) % MARK_EVERY:
            return None
        try:
            async with conn.transaction():
                await conn.execute("SET LOCAL synchronous_commit TO off")
                mark: int = await conn.fetchval(MARK_SQL)
        except asyncpg.PostgresError:  # read-only standby: no ids to take, floors stay 0
            self._marks = False
            return None
        return mark + 1

    async def _snapshot(self, conn: Connection) -> int:
        mark = await self._mark(conn)
        if mark is not None and self._last_top is not None:
            self._history.append((mark, self._last_top))
            if len(self._history) > HISTORY_LIMIT:
                del self._history[1]
        row = await conn.fetchrow(SNAPSHOT_SQL)
        assert row is not None
        self._last_top = row["top"]
        xmin: int = row["xmin"]
        return xmin

    async def start(self, conn: Connection) -> int:
        """Start at the current xmin: the reader delivers transactions that end from now on (and those
        below it have ended)."""
        await self._snapshot(conn)
        self.boundary = await self._snapshot(conn)
        return self.boundary

    async def poll(
        self, conn: Connection, *, wanted: Callable[[], bool] = lambda: True, page: int = 2_000
    ) -> Window | None:
        """The next window, or None when the xmin has not moved past the boundary. The boundary moves
        only with ``advance``, so the caller can hand the window on in the same step. When ``wanted()``
        is false once the xmin is known (nobody to hand events to), the window comes back empty and
        unread, and ``poll`` returns without awaiting after that check."""
        assert self.boundary is not None, "start() first"
        xmin = await self._snapshot(conn)
        lo = self.boundary
        if xmin <= lo:
            return None
        if not wanted():
            return Window(lo, xmin, [])
        events: list[TailEvent] = []
        async for chunk in read_range(conn, lo, xmin, after=self.floor(lo), page=page):
            events.extend(chunk)
        return Window(lo, xmin, events)

    def advance(self, window: Window) -> None:
        """Everything below ``window.hi`` has been read."""
        assert window.lo == self.boundary, "windows are read in order"
        self.boundary = window.hi
