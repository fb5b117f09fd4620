"""holding_periods: the spans over which each lease was held, projected from the log, for replay.

A row per grant (``LOCK_ACQUIRED``, ``LOCK_RENEWED`` or ``LOCK_HANDED_OFF``): a lease is the rows of one
``(resource, fencing_token)``, one per deadline it had; a hand-off's row is the first of the receiver's
lease. A row's validity is ``[granted_at, least(expires_at, ended_at))``: from its grant until its
deadline passes or the stream's next event (a renewal, release, expiry, force-release or hand-off,
``ended_by``) is recorded, whichever comes first. The deadline passing ends the
lease with no ``LOCK_EXPIRED`` recorded yet, as in the decider. At most one row of a stream is valid at
any instant, and it is the one replay's log path finds (``projections/replay.py``): the newest grant whose
span contains T, nothing recorded after it by T. So the leases live at T are one GiST scan for
``valid @> T``, with the deadline as known at T and the lease's start, its acquire or hand-off (when,
which saga step, which reservation), as the log path returns them.

A shared lock's grants (``SHARED_ACQUIRED``, ``SHARED_RENEWED``, docs/decisions/0052) have rows too,
under their stream id ``shared/<resource>`` (so a mutex and the shared lock of one name never share a
key), with the grant's ``mode`` and its lock's ``lock_limit``: a grant is the rows of one token, each
ended by the next event of that token (a renewal, release or expiry), not of the stream, as several grants
live at once.

Every row is a function of the log alone (the grant, the next event when committed, the lease's
acquire), recomputed for the grants an event touches (its own, and the one before it in its stream, or
for a shared lock the one before it of its grant):
applying an event twice, or the events of two transactions in either order, leaves the same table.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Computed, Index, Integer, Table, Text
from sqlalchemy.dialects.postgresql import TIMESTAMP, TSTZRANGE

from domain.events import DEADLINE_FIELD, LEASE_STARTS
from domain.shared_lock import SHARED_ACQUIRED, SHARED_EVENT_TYPES, SHARED_GRANTS, STREAM_PREFIX
from eventstore.connection import Connection
from eventstore.payloads import is_granting_sql, payload_field_sql
from eventstore.schema import metadata
from eventstore.tail import EventKey
from projections.projector import Projection, versions

NAME = "holding_periods"
_STARTS = ", ".join(f"'{name}'" for name in sorted(LEASE_STARTS))
VALIDITY = "tstzrange(granted_at, greatest(granted_at, least(expires_at, ended_at)))"

holding_periods = Table(
    NAME,
    metadata,
    Column("resource", Text, primary_key=True),
    Column("grant_version", BigInteger, primary_key=True),  # the grant's stream version
    Column("owner", Text, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("acquired_at", TIMESTAMP(timezone=True)),  # the lease's acquire, and its saga step
    Column("saga_id", Text),
    Column("saga_step", Text),
    Column("reservation_id", Text),  # the reservation the lease was taken in (migration 0017)
    Column("granted_at", TIMESTAMP(timezone=True), nullable=False),
    Column("expires_at", TIMESTAMP(timezone=True), nullable=False),  # the deadline this grant set
    Column("ended_at", TIMESTAMP(timezone=True)),  # the stream's next event, if any yet
    Column("ended_by", Text),
    Column("mode", Text),  # a shared-lock grant's mode, shared or exclusive; null on a mutex's rows (0018)
    Column("lock_limit", Integer),  # a shared-lock grant's limit (a semaphore's permits), else null
    Column("valid", TSTZRANGE, Computed(VALIDITY, persisted=True), nullable=False),
    Index("holding_periods_valid_idx", "valid", postgresql_using="gist"),
)

# The rows of the grants at the (stream, version) pairs of a key set, made from the log: ``{keys}`` is a
# query of (stream_id, version) pairs, ``{table}`` the table written (the live one or a rebuild's shadow).
_UPSERT = f"""
INSERT INTO {{table}} AS h (resource, grant_version, owner, fencing_token, acquired_at, saga_id, saga_step,
                           reservation_id, granted_at, expires_at, ended_at, ended_by)
SELECT g.stream_id, g.stream_version, g.data ->> 'owner', {payload_field_sql("g.data", "fencing_token")},
       a.recorded_at, a.metadata ->> 'saga_id', a.metadata ->> 'saga_step',
       a.metadata ->> 'reservation_id', g.recorded_at, {payload_field_sql("g.data", DEADLINE_FIELD)},
       n.recorded_at, n.event_type
  FROM ({{keys}}) AS k (stream_id, version)
  JOIN events g ON g.stream_id = k.stream_id AND g.stream_version = k.version
  LEFT JOIN LATERAL (  -- the acquire or hand-off that began the lease, as replay's log path finds it
        SELECT a.recorded_at, a.metadata FROM events a
         WHERE a.stream_id = g.stream_id AND a.event_type IN ({_STARTS})
           AND (a.data ->> 'fencing_token')::bigint = {payload_field_sql("g.data", "fencing_token")}
         LIMIT 1) AS a ON true
  LEFT JOIN LATERAL (
        SELECT n.recorded_at, n.event_type FROM events n
         WHERE n.stream_id = g.stream_id AND n.stream_version = g.stream_version + 1) AS n ON true
 WHERE {is_granting_sql("g.event_type")}
    ON CONFLICT (resource, grant_version) DO UPDATE
   SET ended_at = excluded.ended_at, ended_by = excluded.ended_by
 WHERE h.ended_at IS DISTINCT FROM excluded.ended_at OR h.ended_by IS DISTINCT FROM excluded.ended_by
"""

# An event touches its own version (a grant's row) and the one before (whose row it ends).
_TOUCHED = """SELECT DISTINCT s, v FROM unnest($1::text[], $2::bigint[]) AS e (s, w),
                     LATERAL (VALUES (e.w), (e.w - 1)) AS t (v)"""
# Every grant of transactions below $1, in one pass over the log: each stream's events in version order
# give each grant its next event, and a hash join its lease's start (the same rows as _UPSERT's).
# Written in time order, as the projector writes them, so the leases live at an instant share a few
# pages: the fleet at T reads hundreds of pages, not one per lease.
_BUILD = f"""
INSERT INTO {{table}} (resource, grant_version, owner, fencing_token, acquired_at, saga_id, saga_step,
                      reservation_id, granted_at, expires_at, ended_at, ended_by)
SELECT g.stream_id, g.stream_version, g.data ->> 'owner', g.fencing_token,
       a.recorded_at, a.metadata ->> 'saga_id', a.metadata ->> 'saga_step',
       a.metadata ->> 'reservation_id', g.recorded_at, {payload_field_sql("g.data", DEADLINE_FIELD)},
       g.next_at, g.next_type
  FROM (SELECT stream_id, stream_version, event_type, data, recorded_at, tx_id,
               {payload_field_sql("data", "fencing_token")} AS fencing_token,
               lead(recorded_at) OVER w AS next_at, lead(event_type) OVER w AS next_type
          FROM events WINDOW w AS (PARTITION BY stream_id ORDER BY stream_version)) AS g
  LEFT JOIN (SELECT DISTINCT ON (stream_id, fencing_token) stream_id, recorded_at, metadata,
                    {payload_field_sql("data", "fencing_token")} AS fencing_token
               FROM events WHERE event_type IN ({_STARTS})
              ORDER BY stream_id, fencing_token, stream_version) AS a USING (stream_id, fencing_token)
 WHERE {is_granting_sql("g.event_type")} AND g.tx_id < $1::text::xid8
 ORDER BY g.recorded_at
"""


_SHARED_GRANTS = ", ".join(f"'{name}'" for name in sorted(SHARED_GRANTS))
_SHARED_EVENTS = ", ".join(f"'{name}'" for name in sorted(SHARED_EVENT_TYPES))  # events_shared_grant_idx's
_TOKEN = "fencing_token"
_DATA_TOKEN = payload_field_sql("data", _TOKEN)
_COLUMNS = """resource, grant_version, owner, fencing_token, acquired_at, saga_id, saga_step, reservation_id,
              granted_at, expires_at, ended_at, ended_by, mode, lock_limit"""
# A shared grant's rows: the acquire of its token begins it (when, saga step, reservation, mode, limit),
# and the next event of its token ends each row. ``{keys}`` and ``{table}`` as for _UPSERT.
_UPSERT_SHARED = f"""
INSERT INTO {{table}} AS h ({_COLUMNS})
SELECT g.stream_id, g.stream_version, g.data ->> 'owner', {payload_field_sql("g.data", _TOKEN)},
       a.recorded_at, a.metadata ->> 'saga_id', a.metadata ->> 'saga_step', a.metadata ->> 'reservation_id',
       g.recorded_at, {payload_field_sql("g.data", DEADLINE_FIELD)}, n.recorded_at, n.event_type,
       a.data ->> 'mode', (a.data ->> 'limit')::integer
  FROM ({{keys}}) AS k (stream_id, version)
  JOIN events g ON g.stream_id = k.stream_id AND g.stream_version = k.version
  LEFT JOIN LATERAL (
        SELECT a.recorded_at, a.metadata, a.data FROM events a
         WHERE a.stream_id = g.stream_id AND a.event_type IN ({_SHARED_EVENTS})
           AND {payload_field_sql("a.data", _TOKEN)} = {payload_field_sql("g.data", _TOKEN)}
           AND a.event_type = '{SHARED_ACQUIRED}'  -- the IN above: events_shared_grant_idx's predicate
         LIMIT 1) AS a ON true
  LEFT JOIN LATERAL (
        SELECT n.recorded_at, n.event_type FROM events n
         WHERE n.stream_id = g.stream_id AND n.event_type IN ({_SHARED_EVENTS})
           AND {payload_field_sql("n.data", _TOKEN)} = {payload_field_sql("g.data", _TOKEN)}
           AND n.stream_version > g.stream_version
         ORDER BY n.stream_version LIMIT 1) AS n ON true
 WHERE g.event_type IN ({_SHARED_GRANTS})
    ON CONFLICT (resource, grant_version) DO UPDATE
   SET ended_at = excluded.ended_at, ended_by = excluded.ended_by
 WHERE h.ended_at IS DISTINCT FROM excluded.ended_at OR h.ended_by IS DISTINCT FROM excluded.ended_by
"""
# A shared lock's event touches its own version and the event before it of the same grant.
_TOUCHED_SHARED = f"""SELECT DISTINCT x.stream_id, t.v FROM unnest($1::text[], $2::bigint[]) AS e (s, w)
  JOIN events x ON x.stream_id = e.s AND x.stream_version = e.w
 CROSS JOIN LATERAL (VALUES (x.stream_version), ((
        SELECT max(p.stream_version) FROM events p
         WHERE p.stream_id = x.stream_id AND p.event_type IN ({_SHARED_EVENTS})
           AND {payload_field_sql("p.data", _TOKEN)} = {payload_field_sql("x.data", _TOKEN)}
           AND p.stream_version < x.stream_version))) AS t (v)
 WHERE x.event_type IN ({_SHARED_EVENTS}) AND t.v IS NOT NULL"""
# Every shared grant of transactions below $1 in one pass: each grant's events in version order give
# each row its next event, and a hash join the grant's acquire (the same rows as _UPSERT_SHARED's).
_BUILD_SHARED = f"""
INSERT INTO {{table}} ({_COLUMNS})
SELECT g.stream_id, g.stream_version, g.data ->> 'owner', g.fencing_token,
       a.recorded_at, a.metadata ->> 'saga_id', a.metadata ->> 'saga_step', a.metadata ->> 'reservation_id',
       g.recorded_at, {payload_field_sql("g.data", DEADLINE_FIELD)}, g.next_at, g.next_type,
       a.data ->> 'mode', (a.data ->> 'limit')::integer
  FROM (SELECT stream_id, stream_version, event_type, data, recorded_at, tx_id,
               {_DATA_TOKEN} AS fencing_token,
               lead(recorded_at) OVER w AS next_at, lead(event_type) OVER w AS next_type
          FROM events WHERE event_type IN ({_SHARED_EVENTS})
        WINDOW w AS (PARTITION BY stream_id, {_DATA_TOKEN} ORDER BY stream_version)) AS g
  LEFT JOIN (SELECT stream_id, recorded_at, metadata, data, {_DATA_TOKEN} AS fencing_token
               FROM events WHERE event_type = '{SHARED_ACQUIRED}') AS a USING (stream_id, fencing_token)
 WHERE g.event_type IN ({_SHARED_GRANTS}) AND g.tx_id < $1::text::xid8
 ORDER BY g.recorded_at
"""


async def apply(conn: Connection, table: str, keys: list[tuple[str, int]]) -> None:
    """Make the rows the events at ``keys`` (stream, version) touch equal to what the log implies: a
    mutex's and a shared lock's, each by its statement."""
    for statement, touched, chosen in (
        (_UPSERT, _TOUCHED, [key for key in keys if not key[0].startswith(STREAM_PREFIX)]),
        (_UPSERT_SHARED, _TOUCHED_SHARED, [key for key in keys if key[0].startswith(STREAM_PREFIX)]),
    ):
        if chosen:
            streams, versions = zip(*chosen, strict=True)
            await conn.execute(statement.format(table=table, keys=touched), list(streams), list(versions))


async def build(conn: Connection, table: str, below: int) -> None:
    """Fill the empty ``table`` with the rows of every grant of a transaction below ``below``."""
    await conn.execute(_BUILD.format(table=table), str(below))
    await conn.execute(_BUILD_SHARED.format(table=table), str(below))


async def _apply_events(conn: Connection, table: str, events: list[EventKey]) -> None:
    await apply(conn, table, versions(events))


HOLDING_PERIODS = Projection(NAME, _apply_events, build)
