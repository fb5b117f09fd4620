"""Replay: the fleet's leases at any past instant, what changed between two instants, timelines, export.

Everything here can be answered from the events table alone, through indexes derived from it
(migration 0005):

- A grant (``LOCK_ACQUIRED``, ``LOCK_RENEWED`` or ``LOCK_HANDED_OFF``) keeps its lease over
  ``[recorded_at, deadline)`` unless the stream's next event ends, renews or hands it off sooner. A
  hand-off is the next event of the giver's last grant and the first grant of the receiver's lease, so
  at its instant the one lease ends and the other is live: never none, never both. So the leases live at
  T are the grants whose span contains T (a GiST index on that span) and whose stream has no later event
  recorded at or before T. The deadline passing ends a lease whether or not its ``LOCK_EXPIRED`` was
  recorded yet, as in the decider.
- Within a stream, events are recorded in version order (each append locks the stream's head and reads
  the clock after), which is what lets "the next event" be the one at version + 1.

A shared lock's grants (stream ``shared/<resource>``, docs/decisions/0051, 0052) are live alike, each by
its own token: the newest of its grant's ``SHARED_ACQUIRED`` or ``SHARED_RENEWED`` whose span contains T,
no later event of that grant recorded by T. They are listed under their plain resource, after the mutex
of the same name, in token order, with their mode and limit; a page's cursor is then ``resource/token``.

``state_at`` reads ``holding_periods`` instead (one GiST scan, ``projections/holding_periods.py``) when its
projector's checkpoint covers T (every event recorded by T applied), and the log otherwise: the same
answer either way, the log's only slower.

Times are half-open ``[from, to)`` for timelines and export; ``changes`` covers ``(from, to]``, so the state
at ``to`` is the state at ``from`` with the changes applied.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from domain.events import GRANTING_EVENTS, LEASE_STARTS, LOCK_HANDED_OFF
from domain.shared_lock import SHARED_ACQUIRED, SHARED_EVENT_TYPES, SHARED_GRANTS, STREAM_PREFIX
from domain.timestamps import format_timestamp
from eventstore.connection import Connection
from eventstore.payloads import timestamp_text_sql
from projections.holding_periods import HOLDING_PERIODS

LEASE_LAPSED = "LEASE_LAPSED"  # a change with no event: a deadline passed and nothing was recorded yet

_GRANTS = ", ".join(f"'{name}'" for name in sorted(GRANTING_EVENTS))
_STARTS = ", ".join(f"'{name}'" for name in sorted(LEASE_STARTS))
_SPAN = "tstzrange(g.recorded_at, event_deadline(g.data))"  # as indexed by events_lease_span_idx
_SHARED_GRANTS = ", ".join(f"'{name}'" for name in sorted(SHARED_GRANTS))  # events_shared_span_idx's
_SHARED_EVENTS = ", ".join(f"'{name}'" for name in sorted(SHARED_EVENT_TYPES))  # events_shared_grant_idx's
_PREFIX_LENGTH = len(STREAM_PREFIX)


def _no_event_after(grant: str, instant: str) -> str:
    """SQL: ``grant``'s stream recorded nothing after it, at or before ``instant``."""
    return f"""NOT EXISTS (
        SELECT 1 FROM events n
         WHERE n.stream_id = {grant}.stream_id AND n.stream_version = {grant}.stream_version + 1
           AND n.recorded_at <= {instant})"""


def _no_grant_event_after(grant: str, instant: str, token: str | None = None) -> str:
    """SQL: nothing was recorded after the shared-lock event ``grant`` for its grant (``token``, or its
    payload's), at or before ``instant``."""
    token = token or f"({grant}.data ->> 'fencing_token')::bigint"
    return f"""NOT EXISTS (
        SELECT 1 FROM events n
         WHERE n.stream_id = {grant}.stream_id AND n.event_type IN ({_SHARED_EVENTS})
           AND (n.data ->> 'fencing_token')::bigint = {token}
           AND n.stream_version > {grant}.stream_version AND n.recorded_at <= {instant})"""


def _filters(alias: str, prefix: str, owner: str, *, giver: bool = False, shared: bool = False) -> str:
    """SQL: the event ``alias`` is on a stream starting with ``prefix`` (with ``shared``, also a shared
    lock's whose resource does) and names ``owner`` (each NULL: any): as its holder, or with ``giver``,
    also as the giver of a hand-off (``from_owner``), so an agent's changes and export show the hand-offs
    it gave; a lease held is filtered by its holder alone."""
    gave = f" OR {alias}.data ->> 'from_owner' = {owner}" if giver else ""
    also = f" OR starts_with({alias}.stream_id, '{STREAM_PREFIX}' || {prefix})" if shared else ""
    return f"""({prefix}::text IS NULL OR starts_with({alias}.stream_id, {prefix}){also})
       AND ({owner}::text IS NULL OR {alias}.data ->> 'owner' = {owner}{gave})"""


# The answer at $1 in one statement, and so one snapshot: the clock (a future instant is refused), the
# position of the last event recorded at or before $1, and a page of the leases live at $1 after the
# cursor ($4 a resource; $6 a shared grant's token of it, or NULL: after its mutex), as the API's JSON
# array (rendered here: a whole fleet is thousands of leases), with the cursor to resume after when there
# are more than $5.
# Positions are drawn in the statement that reads the clock for recorded_at, so the newest position at
# or before T is among the events of the last minute before T, if there are any (an index-only scan:
# the time index carries the position).
_LEASE_JSON = f"""json_build_object(
    'resource', l.resource, 'owner', l.owner, 'fencing_token', l.fencing_token,
    'acquired_at', {timestamp_text_sql("l.acquired_at")}, 'expires_at', {timestamp_text_sql("l.expires_at")},
    'saga_id', l.saga_id, 'saga_step', l.saga_step, 'reservation_id', l.reservation_id,
    'mode', l.mode, 'limit', l.lock_limit)"""
_ORDER = "l.resource, l.shared, l.fencing_token"  # a mutex, then the shared grants of its name


def _answer(live: str) -> str:
    """SQL of the answer whose leases are ``live``: a query of the leases (with ``shared``, whether a
    shared grant) in ``_ORDER``, LIMIT $5 + 1."""
    return f"""
SELECT head.db_now, head.position, page.locks, page.next_cursor
  FROM (SELECT clock_timestamp() AS db_now, coalesce(
               (SELECT max(position + 0) FROM events  -- + 0: found by time, not by scanning positions
                 WHERE recorded_at > $1::timestamptz - interval '1 minute' AND recorded_at <= $1),
               (SELECT position FROM events WHERE recorded_at <= $1
                 ORDER BY recorded_at DESC, position DESC LIMIT 1),
               0) AS position) AS head
 CROSS JOIN (
    SELECT coalesce(json_agg(p.lease ORDER BY p.n) FILTER (WHERE p.n <= $5), '[]')::text AS locks,
           max(p.cursor) FILTER (WHERE p.n = $5 AND p.more) AS next_cursor
      FROM (SELECT {_LEASE_JSON} AS lease,
                   CASE WHEN l.shared THEN l.resource || '/' || l.fencing_token ELSE l.resource END AS cursor,
                   row_number() OVER (ORDER BY {_ORDER}) AS n, count(*) OVER () > $5 AS more
              FROM ({live}) AS l) AS p
 ) AS page
"""


# From the log: of a stream's grants whose span contains $1 only the newest can be the live one
# (renewals overlap), so only it is checked for a later event; of a shared lock's, the newest of each
# grant, checked for a later event of that grant.
_MUTEX_AT = f"""
    SELECT g.stream_id AS resource, false AS shared, g.owner, g.fencing_token, g.expires_at,
           a.recorded_at AS acquired_at, a.metadata ->> 'saga_id' AS saga_id,
           a.metadata ->> 'saga_step' AS saga_step, a.metadata ->> 'reservation_id' AS reservation_id,
           NULL::text AS mode, NULL::integer AS lock_limit
      FROM (SELECT DISTINCT ON (c.stream_id) c.stream_id, c.stream_version, c.event_type, c.recorded_at,
                   c.data ->> 'owner' AS owner, (c.data ->> 'fencing_token')::bigint AS fencing_token,
                   event_deadline(c.data) AS expires_at
              FROM events c
             WHERE c.event_type IN ({_GRANTS}) AND {_SPAN.replace("g.", "c.")} @> $1::timestamptz
               AND {_filters("c", "$2", "$3")}
               AND ($4::text IS NULL OR c.stream_id > $4)
             ORDER BY c.stream_id, c.stream_version DESC) AS g
      LEFT JOIN LATERAL (  -- the acquire or hand-off that began the lease: when, saga step, reservation
            SELECT a.recorded_at, a.metadata FROM events a
             WHERE a.stream_id = g.stream_id AND a.event_type IN ({_STARTS})
               AND (a.data ->> 'fencing_token')::bigint = g.fencing_token
             LIMIT 1) AS a ON true
     WHERE {_no_event_after("g", "$1")}
     ORDER BY g.stream_id
     LIMIT $5 + 1"""
_SHARED_AT = f"""
    SELECT substr(g.stream_id, {_PREFIX_LENGTH + 1}) AS resource, true AS shared, g.owner, g.fencing_token,
           g.expires_at, a.recorded_at AS acquired_at, a.metadata ->> 'saga_id' AS saga_id,
           a.metadata ->> 'saga_step' AS saga_step, a.metadata ->> 'reservation_id' AS reservation_id,
           a.data ->> 'mode' AS mode, (a.data ->> 'limit')::integer AS lock_limit
      FROM (SELECT DISTINCT ON (c.stream_id, (c.data ->> 'fencing_token')::bigint)
                   c.stream_id, c.stream_version, c.data ->> 'owner' AS owner,
                   (c.data ->> 'fencing_token')::bigint AS fencing_token, event_deadline(c.data) AS expires_at
              FROM events c
             WHERE c.event_type IN ({_SHARED_GRANTS}) AND {_SPAN.replace("g.", "c.")} @> $1::timestamptz
               AND ($2::text IS NULL OR starts_with(c.stream_id, '{STREAM_PREFIX}' || $2))
               AND ($3::text IS NULL OR c.data ->> 'owner' = $3)
               AND ($4::text IS NULL OR c.stream_id > '{STREAM_PREFIX}' || $4
                    OR (c.stream_id = '{STREAM_PREFIX}' || $4
                        AND ($6::bigint IS NULL OR (c.data ->> 'fencing_token')::bigint > $6)))
             ORDER BY c.stream_id, (c.data ->> 'fencing_token')::bigint, c.stream_version DESC) AS g
      LEFT JOIN LATERAL (  -- the grant's acquire: when, saga step, reservation, mode and limit
            SELECT a.recorded_at, a.metadata, a.data FROM events a
             WHERE a.stream_id = g.stream_id AND a.event_type IN ({_SHARED_EVENTS})
               AND (a.data ->> 'fencing_token')::bigint = g.fencing_token
               AND a.event_type = '{SHARED_ACQUIRED}'
             LIMIT 1) AS a ON true
     WHERE {_no_grant_event_after("g", "$1", "g.fencing_token")}
     ORDER BY g.stream_id, g.fencing_token
     LIMIT $5 + 1"""
STATE_SQL = _answer(f"""
    SELECT * FROM (({_MUTEX_AT}) UNION ALL ({_SHARED_AT})) AS l
     ORDER BY {_ORDER}
     LIMIT $5 + 1""")
# The same answer from holding_periods, for an instant its projector has covered: the rows valid at $1
# (projections/holding_periods.py; a shared grant's under its stream id), one GiST scan.
_HELD = f"""(
    SELECT CASE WHEN starts_with(h.resource, '{STREAM_PREFIX}') THEN substr(h.resource, {_PREFIX_LENGTH + 1})
                ELSE h.resource END AS resource,
           starts_with(h.resource, '{STREAM_PREFIX}') AS shared,
           h.owner, h.fencing_token, h.expires_at, h.acquired_at, h.saga_id, h.saga_step, h.reservation_id,
           h.mode, h.lock_limit
      FROM {HOLDING_PERIODS.name} h
     WHERE h.valid @> $1::timestamptz AND ($3::text IS NULL OR h.owner = $3))"""
HELD_AT_SQL = _answer(f"""
    SELECT * FROM {_HELD} AS l
     WHERE ($2::text IS NULL OR starts_with(l.resource, $2))
       AND ($4::text IS NULL OR l.resource > $4
            OR (l.resource = $4 AND l.shared AND ($6::bigint IS NULL OR l.fencing_token > $6)))
     ORDER BY {_ORDER}
     LIMIT $5 + 1""")
COVERED_SQL = "SELECT covered_until FROM projector_checkpoints WHERE name = $1"
LOG, PROJECTION = "log", HOLDING_PERIODS.name


@dataclass(frozen=True, slots=True)
class LiveLease:
    resource: str
    owner: str
    fencing_token: int
    acquired_at: datetime | None  # None: its acquire is in an archived partition
    expires_at: datetime  # the deadline as known at the instant asked about
    saga_id: str | None  # the saga, and its step, the lease was acquired for
    saga_step: str | None
    reservation_id: str | None  # the reservation the lease was taken in (decision 0048)
    mode: str | None = None  # a shared-lock grant's mode, shared or exclusive; None for a mutex lease
    limit: int | None = None  # a shared-lock grant's limit (a semaphore's permits); None otherwise


@dataclass(frozen=True, slots=True)
class StateAt:
    at: datetime
    position: int  # the last event recorded at or before ``at`` (0: none)
    locks_json: str  # the page's leases, a JSON array as the API answers them (LiveLease's fields)
    next_cursor: str | None
    source: str = LOG  # what answered: the log, or holding_periods (PROJECTION)

    @property
    def locks(self) -> list[LiveLease]:
        """The page's leases, parsed."""
        return [_live_lease(lease) for lease in json.loads(self.locks_json)]


def _live_lease(lease: dict[str, Any]) -> LiveLease:
    acquired_at = lease["acquired_at"]
    return LiveLease(
        lease["resource"],
        lease["owner"],
        lease["fencing_token"],
        None if acquired_at is None else datetime.fromisoformat(acquired_at),
        datetime.fromisoformat(lease["expires_at"]),
        lease["saga_id"],
        lease["saga_step"],
        lease["reservation_id"],
        lease["mode"],
        lease["limit"],
    )


# A state cursor: the resource of the page's last lease, with ``/token`` when it was a shared grant.
STATE_CURSOR_PATTERN = r"^[A-Za-z0-9._:\-]*[A-Za-z0-9_:\-][A-Za-z0-9._:\-]*(/\d{1,18})?$"


def parse_state_cursor(cursor: str) -> tuple[str, int | None]:
    """The resource and shared grant's token (None: after the resource's mutex) a state cursor names."""
    resource, _, token = cursor.partition("/")
    return resource, int(token) if token else None


class FutureInstant(ValueError):
    """The instant asked about has not happened yet by the database clock."""


async def state_at(
    conn: Connection,
    at: datetime,
    *,
    prefix: str | None = None,
    owner: str | None = None,
    cursor: str | None = None,
    limit: int = 100,
    use_projection: bool = True,
) -> StateAt:
    """Every lease and shared grant live at ``at``, by resource, a page of ``limit`` after ``cursor`` (a
    resource, or ``resource/token`` for a shared grant): from holding_periods when its projector has
    covered ``at`` (and ``use_projection``), else from the log; the same answer."""
    covered = await conn.fetchval(COVERED_SQL, HOLDING_PERIODS.name) if use_projection else None
    source = PROJECTION if covered is not None and at <= covered else LOG
    sql = HELD_AT_SQL if source == PROJECTION else STATE_SQL
    after, token = parse_state_cursor(cursor) if cursor is not None else (None, None)
    answer = await conn.fetchrow(sql, at, prefix, owner, after, limit, token)
    assert answer is not None  # one row, always
    if at > answer["db_now"]:
        raise FutureInstant(
            f"{format_timestamp(at)} is in the future"
            f" (the database clock reads {format_timestamp(answer['db_now'])});"
            " replay answers for past instants"
        )
    return StateAt(at, answer["position"], answer["locks"], answer["next_cursor"], source)


# Events recorded in ($1, $2], and the leases and shared grants whose deadline passed in ($1, $2] with
# nothing recorded for them by $2, in time order; a page after the cursor (at, position or for a lapse
# the largest bigint, less a shared grant's token, stream). A shared lock's changes name its stream
# (``shared/<resource>``), and the prefix $3 matches them by resource.
CHANGES_SQL = f"""
SELECT * FROM (
    SELECT e.recorded_at AS at, e.event_type AS type, e.stream_id AS resource, e.data ->> 'owner' AS owner,
           (e.data ->> 'fencing_token')::bigint AS fencing_token, e.position, e.stream_version AS version,
           e.data::text AS data, e.position AS sort_position
      FROM events e
     WHERE e.recorded_at > $1 AND e.recorded_at <= $2
       AND {_filters("e", "$3", "$4", giver=True, shared=True)}
    UNION ALL
    SELECT event_deadline(g.data), '{LEASE_LAPSED}', g.stream_id, g.data ->> 'owner',
           (g.data ->> 'fencing_token')::bigint, NULL, NULL, g.data::text, 9223372036854775807
      FROM events g
     WHERE g.event_type IN ({_GRANTS}) AND {_SPAN} && tstzrange($1, $2, '(]')
       AND event_deadline(g.data) > $1 AND event_deadline(g.data) <= $2
       AND {_filters("g", "$3", "$4")}
       AND {_no_event_after("g", "$2")}
    UNION ALL  -- a shared lock's lapses sort by token: several of its grants may lapse at one instant
    SELECT event_deadline(g.data), '{LEASE_LAPSED}', g.stream_id, g.data ->> 'owner',
           (g.data ->> 'fencing_token')::bigint, NULL, NULL, g.data::text,
           9223372036854775807 - (g.data ->> 'fencing_token')::bigint
      FROM events g
     WHERE g.event_type IN ({_SHARED_GRANTS}) AND {_SPAN} && tstzrange($1, $2, '(]')
       AND event_deadline(g.data) > $1 AND event_deadline(g.data) <= $2
       AND ($3::text IS NULL OR starts_with(g.stream_id, '{STREAM_PREFIX}' || $3))
       AND ($4::text IS NULL OR g.data ->> 'owner' = $4)
       AND {_no_grant_event_after("g", "$2")}
) AS c
 WHERE $5::timestamptz IS NULL OR (c.at, c.sort_position, c.resource) > ($5, $6::bigint, $7::text)
 ORDER BY c.at, c.sort_position, c.resource
 LIMIT $8
"""


@dataclass(frozen=True, slots=True)
class Change:
    at: datetime
    type: str
    resource: str
    owner: str | None
    fencing_token: int | None
    position: int | None  # None for LEASE_LAPSED, which no event records
    version: int | None
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ChangePage:
    changes: list[Change]
    next_cursor: str | None


_LAPSE_SORT = 2**63 - 1
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A changes cursor: microseconds since 1970 (16 digits from 2001 to 2286), position (for a lapse, the
# largest bigint, less a shared grant's token), stream ("/": a shared lock's).
CHANGE_CURSOR_PATTERN = r"^\d{1,16}\.\d{1,19}\.[A-Za-z0-9._:/\-]{1,207}$"


def _change_cursor(row: Any) -> str:
    """The cursor after the change of CHANGES_SQL's ``row``."""
    micros = (row["at"] - _EPOCH) // timedelta(microseconds=1)
    return f"{micros}.{row['sort_position']}.{row['resource']}"


def parse_change_cursor(cursor: str) -> tuple[datetime, int, str]:
    """The (instant, position, resource) a changes cursor stands for (see CHANGE_CURSOR_PATTERN)."""
    micros, position, resource = cursor.split(".", 2)
    return _EPOCH + timedelta(microseconds=int(micros)), min(int(position), _LAPSE_SORT), resource


async def changes(
    conn: Connection,
    start: datetime,
    end: datetime,
    *,
    prefix: str | None = None,
    owner: str | None = None,
    cursor: str | None = None,
    limit: int = 100,
) -> ChangePage:
    """What changed after ``start`` up to ``end``: the events, and the leases that lapsed unrecorded."""
    after = parse_change_cursor(cursor) if cursor is not None else (None, None, None)
    rows = await conn.fetch(CHANGES_SQL, start, end, prefix, owner, *after, limit + 1)
    items = [
        Change(
            r["at"], r["type"], r["resource"], r["owner"], r["fencing_token"], r["position"],
            r["version"], json.loads(r["data"]),
        )
        for r in rows[:limit]
    ]  # fmt: skip
    return ChangePage(items, _change_cursor(rows[limit - 1]) if len(rows) > limit else None)


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    position: int
    resource: str
    version: int
    event_id: str
    type: str
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: datetime


_EVENT_COLUMNS = """position, stream_id, stream_version, event_id::text AS event_id, event_type,
       data::text AS data, metadata::text AS metadata, recorded_at"""


def _logged(row: Any) -> LoggedEvent:
    return LoggedEvent(
        row["position"], row["stream_id"], row["stream_version"], row["event_id"], row["event_type"],
        json.loads(row["data"]), json.loads(row["metadata"]), row["recorded_at"],
    )  # fmt: skip


RESOURCE_HISTORY_SQL = f"""
SELECT {_EVENT_COLUMNS} FROM events
 WHERE stream_id = $1 AND stream_version > $2
   AND ($3::timestamptz IS NULL OR recorded_at >= $3) AND ($4::timestamptz IS NULL OR recorded_at < $4)
 ORDER BY stream_version
 LIMIT $5
"""

# The events naming the agent as holder (events_owner_idx) and the hand-offs it gave
# (events_from_owner_idx), merged in position order.
_AGENT_WINDOW = """position > $2
   AND ($3::timestamptz IS NULL OR recorded_at >= $3) AND ($4::timestamptz IS NULL OR recorded_at < $4)"""
AGENT_HISTORY_SQL = f"""
SELECT * FROM (
    SELECT {_EVENT_COLUMNS} FROM events WHERE data ->> 'owner' = $1 AND {_AGENT_WINDOW}
    UNION ALL
    SELECT {_EVENT_COLUMNS} FROM events
     WHERE event_type = '{LOCK_HANDED_OFF}' AND data ->> 'from_owner' = $1 AND {_AGENT_WINDOW}
) AS agent
 ORDER BY position
 LIMIT $5
"""


async def resource_history(
    conn: Connection,
    stream: str,
    *,
    after_version: int = 0,
    start: datetime | None = None,
    end: datetime | None = None,
    limit: int = 100,
) -> list[LoggedEvent]:
    """One stream's events in version order, after ``after_version``, recorded in ``[start, end)``: a
    mutex's (its resource) or a shared lock's (``shared/<resource>``)."""
    rows = await conn.fetch(RESOURCE_HISTORY_SQL, stream, after_version, start, end, limit)
    return [_logged(row) for row in rows]


async def agent_history(
    conn: Connection,
    owner: str,
    *,
    after_position: int = 0,
    start: datetime | None = None,
    end: datetime | None = None,
    limit: int = 100,
) -> list[LoggedEvent]:
    """One agent's events across every resource, in log order, recorded in ``[start, end)``: those it
    held a lease by, and the hand-offs it gave."""
    rows = await conn.fetch(AGENT_HISTORY_SQL, owner, after_position, start, end, limit)
    return [_logged(row) for row in rows]


EXPORT_FETCH_TIMEOUT_S = 600.0

# One NDJSON line per event, written by PostgreSQL: the export never parses and re-encodes a payload.
EXPORT_SQL = f"""
SELECT json_build_object(
         'position', position, 'stream', stream_id, 'version', stream_version, 'event_id', event_id,
         'type', event_type, 'data', data, 'metadata', metadata,
         'recorded_at', {timestamp_text_sql("recorded_at")},
         'hash', encode(hash, 'hex'))::text AS line
  FROM events
 WHERE position > $1
   AND ($2::timestamptz IS NULL OR recorded_at >= $2) AND ($3::timestamptz IS NULL OR recorded_at < $3)
   AND ($4::text IS NULL OR event_type = $4)
   AND {_filters("events", "$5", "$6", giver=True)}
 ORDER BY position
"""


async def export_lines(
    conn: Connection,
    *,
    after_position: int = 0,
    start: datetime | None = None,
    end: datetime | None = None,
    event_type: str | None = None,
    owner: str | None = None,
    prefix: str | None = None,
    prefetch: int = 2_000,
) -> AsyncIterator[str]:
    """The matching events as JSON lines, in position order, through a server-side cursor: memory stays
    flat whatever the range. Needs a transaction on ``conn`` for as long as it is iterated."""
    args = (after_position, start, end, event_type, prefix, owner)
    # A fetch may wait long for the next match (a narrow filter over a long log, or a range sorted
    # first): no statement timeout in this transaction, and a generous bound on each fetch.
    await conn.execute("SET LOCAL statement_timeout = 0")
    async for row in conn.cursor(EXPORT_SQL, *args, prefetch=prefetch, timeout=EXPORT_FETCH_TIMEOUT_S):
        yield row["line"]
