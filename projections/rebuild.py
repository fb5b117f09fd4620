"""Rebuild what is derived from the log: the lock_state, saga_state and shared-lock projections, and the
indexes replay reads.

The rebuilt table must equal the inline one row for row (tests/storage/test_rebuild.py proves it after
a random workload). Each row is what ``domain.decider.evolve`` makes of the stream's last event (its
payload read through ``eventstore/payloads.py``), with the lease length of the last grant, when, for
which saga step and in which reservation the lease began (its acquire or hand-off), and the giver of a
hand-off still awaiting acceptance: the last event but outage extensions (which leave that mark alone)
is the hand-off. It runs set-wise in SQL under an EXCLUSIVE lock on lock_state, which every command and
the reaper need (they lock a lock_state row first), so the log cannot move while it runs.
"""

from __future__ import annotations

from domain.events import DEADLINE_FIELD, LEASE_STARTS, LOCK_HANDED_OFF, LOCK_RENEWED, PAYLOAD_FIELDS
from eventstore.connection import Connection
from eventstore.payloads import is_granting_sql, payload_field_sql
from projections.saga_state import rebuild_saga_state
from projections.shared_locks import rebuild_shared_locks

_LAST_DATA = "last.data"
# Saga streams (saga:<id>) share the events table; lock_state holds the lock streams alone.
_IS_LOCK_EVENT = f"event_type IN ({', '.join(repr(name) for name in sorted(PAYLOAD_FIELDS))})"
_STARTS_LEASE = f"event_type IN ({', '.join(repr(name) for name in sorted(LEASE_STARTS))})"
# The outage extension's LOCK_RENEWED (service/outage.py): not the holder's doing.
_EXTENSION = f"(event_type = '{LOCK_RENEWED}' AND metadata ->> 'command' = 'extend')"

REBUILD_SQL = f"""
INSERT INTO lock_state (resource, version, status, owner, fencing_token, ttl_ms, expires_at, ended_by,
                        acquired_at, updated_at, saga_id, saga_step, reservation_id, handed_off_by)
SELECT last.stream_id,
       last.stream_version,
       CASE WHEN {is_granting_sql("last.event_type")} THEN 'held' ELSE 'free' END,
       {payload_field_sql(_LAST_DATA, "owner")},
       {payload_field_sql(_LAST_DATA, "fencing_token")},
       grant_.ttl_ms,
       {payload_field_sql(_LAST_DATA, DEADLINE_FIELD)},
       CASE WHEN {is_granting_sql("last.event_type")} THEN NULL ELSE last.event_type END,
       acquired.recorded_at,
       last.recorded_at,
       acquired.metadata ->> 'saga_id',
       acquired.metadata ->> 'saga_step',
       acquired.metadata ->> 'reservation_id',
       CASE WHEN {is_granting_sql("last.event_type")} AND taken.event_type = '{LOCK_HANDED_OFF}'
            THEN {payload_field_sql("taken.data", "from_owner")} END
  FROM (SELECT DISTINCT ON (stream_id) stream_id, stream_version, event_type, data, recorded_at
          FROM events WHERE {_IS_LOCK_EVENT} ORDER BY stream_id, stream_version DESC) AS last
  LEFT JOIN (SELECT DISTINCT ON (stream_id) stream_id, {payload_field_sql("data", "ttl_ms")} AS ttl_ms
               FROM events WHERE {is_granting_sql("event_type")}
              ORDER BY stream_id, stream_version DESC) AS grant_ USING (stream_id)
  LEFT JOIN (SELECT DISTINCT ON (stream_id) stream_id, recorded_at, metadata
               FROM events WHERE {_STARTS_LEASE}
              ORDER BY stream_id, stream_version DESC) AS acquired USING (stream_id)
  LEFT JOIN (SELECT DISTINCT ON (stream_id) stream_id, event_type, data
               FROM events WHERE {_IS_LOCK_EVENT} AND NOT {_EXTENSION}
              ORDER BY stream_id, stream_version DESC) AS taken USING (stream_id)
"""


async def rebuild_lock_state(conn: Connection) -> int:
    """Replace every lock_state row by the one the log implies; returns the number of rows.

    Needs DELETE on lock_state, which the service role does not have: run it as the schema owner.
    """
    async with conn.transaction():
        await conn.execute("LOCK TABLE lock_state IN EXCLUSIVE MODE")
        await conn.execute("DELETE FROM lock_state")
        status = await conn.execute(REBUILD_SQL)
        # The other inline projections, saga_state and the shared locks', in the same transaction
        # (`lockledger rebuild` calls this function alone).
        await rebuild_saga_state(conn)
        await rebuild_shared_locks(conn)
    return int(status.split()[-1])


REPLAY_INDEXES = (
    "events_lease_span_idx",
    "events_owner_idx",
    "events_lease_start_idx",
    "events_from_owner_idx",
    "events_shared_span_idx",
    "events_shared_grant_idx",
)


async def rebuild_replay_indexes(conn: Connection) -> tuple[str, ...]:
    """Rebuild the indexes replay reads (migrations 0005, 0018) from the events they cover, without blocking
    appends (``REINDEX ... CONCURRENTLY``: run it outside a transaction); returns their names."""
    for index in REPLAY_INDEXES:
        await conn.execute(f"REINDEX INDEX CONCURRENTLY {index}")
    return REPLAY_INDEXES
