"""What a reaper pass does in PostgreSQL (the ``ReaperStore`` port, ``service/ports.py``).

Expiry is one statement that picks due leases with ``FOR UPDATE SKIP LOCKED`` (so several reapers share
the work without waiting on each other) and re-checks the deadline on the locked row, so a renew that
committed first wins and is never expired. It appends ``LOCK_EXPIRED`` exactly as the decider would
(``domain.decide(Expire)``), set-wise for throughput. The lapsed sagas are an index scan of
``saga_state_lease_idx``; old Idempotency-Keys go in batches, planned afresh each time.
"""

from __future__ import annotations

import asyncpg

from domain.events import LOCK_EXPIRED
from eventstore.connection import Connection
from eventstore.event_ids import event_id_sql
from eventstore.payloads import build_payload_sql
from projections.lock_state import lapsed_sql
from service.database import connection
from service.ports import DueSaga, Expiry

# LOCK_EXPIRED's payload from the lapsed lease's row, as domain.decide(Expire) would write it.
_EXPIRED_PAYLOAD = build_payload_sql(
    LOCK_EXPIRED, owner="owner", fencing_token="fencing_token", expires_at="expires_at"
)

EXPIRE_DUE_SQL = f"""
WITH due AS (
    SELECT resource, version, owner, fencing_token, expires_at
      FROM lock_state
     WHERE status = 'held' AND {lapsed_sql("expires_at", "clock_timestamp()")}
       -- The same bound, stable for the statement, so that the partial index on expires_at stops at the
       -- first deadline still ahead: clock_timestamp() (volatile, and the one re-checked on each locked
       -- row) cannot bound an index scan, which then walked every held lease on every pass.
       AND expires_at <= statement_timestamp()
       -- With $3 (the outage threshold, ms): nothing while the beacon is older than it. An outage has
       -- just ended and its extension (service/outage.py) is not written yet; a pass that was in flight
       -- when the database stopped must not expire what lapsed during the outage.
       AND NOT EXISTS (
           SELECT 1 FROM outage_beacon
            WHERE id = 1 AND $3::integer IS NOT NULL
              AND beat_at < clock_timestamp() - $3::integer * interval '1 ms'
       )
     ORDER BY expires_at
     LIMIT $1::integer
       FOR UPDATE SKIP LOCKED
),
stamped AS (
    SELECT due.*, clock_timestamp() AS ts FROM due
),
appended AS (
    INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata, recorded_at)
    SELECT resource, version + 1, {event_id_sql("ts")},
           '{LOCK_EXPIRED}',
           {_EXPIRED_PAYLOAD},
           jsonb_build_object('command', 'expire', 'actor', 'reaper', 'reaper_id', $2::text),
           ts
      FROM stamped
 RETURNING stream_id
),
projected AS (
    UPDATE lock_state AS s
       SET version = st.version + 1, status = 'free', ended_by = '{LOCK_EXPIRED}', updated_at = st.ts,
           handed_off_by = NULL
      FROM stamped AS st
     WHERE s.resource = st.resource
 RETURNING s.resource
)
SELECT resource, fencing_token, expires_at, ts FROM stamped
"""


async def expire_due(
    conn: Connection, batch_size: int, reaper_id: str, outage_after_ms: int | None = None
) -> list[Expiry]:
    """One pass: expire up to ``batch_size`` lapsed leases in one transaction; none, given the outage
    threshold, while the beacon says an outage may have just ended unextended."""
    rows = await conn.fetch(EXPIRE_DUE_SQL, batch_size, reaper_id, outage_after_ms)
    return [Expiry(r["resource"], r["fencing_token"], r["expires_at"], r["ts"]) for r in rows]


# Planned afresh at every run (see purge_expired), so written with its two integers in place.
PURGE_SQL = """
DELETE FROM idempotency_keys
 WHERE ctid = ANY(ARRAY(
       SELECT ctid FROM idempotency_keys
        WHERE created_at < clock_timestamp() - {retention_s:d} * interval '1 second'
        ORDER BY created_at
        LIMIT {batch:d}))
"""


async def purge_expired(conn: Connection, retention_s: int, batch: int) -> int:
    """Delete up to ``batch`` keys older than the retention window; returns how many went.

    Sent as a simple query, never prepared, so PostgreSQL plans it for the table as it is now. A plan
    cached on a new database, while the table was empty, joined the old keys against a sequential scan
    of the whole table (cheapest for ten pages), and would have kept doing so once the table held a
    day of keys; planned afresh, a large table is probed by the old keys' row addresses. It runs every
    few seconds at most, so planning it costs nothing that matters.
    """
    status = await conn.execute(PURGE_SQL.format(retention_s=int(retention_s), batch=int(batch)))
    return int(status.split()[-1])


# Tickets of waiters that never left (their server died): they stopped counting at their deadline
# (docs/decisions/0049-fair-queues.md); this only keeps the table small.
PURGE_TICKETS_SQL = """
DELETE FROM lock_queue
 WHERE ticket = ANY(ARRAY(
       SELECT ticket FROM lock_queue WHERE deadline < clock_timestamp() ORDER BY deadline LIMIT $1))
"""


DUE_SQL = """
SELECT saga_id, clock_timestamp() AS now FROM saga_state
 WHERE lease_expires_at IS NOT NULL AND lease_expires_at <= clock_timestamp()
 ORDER BY lease_expires_at
 LIMIT $1
"""


async def due_sagas(conn: Connection, limit: int) -> list[DueSaga]:
    """Up to ``limit`` unfinished sagas whose lease deadline has passed, each with the clock that saw it."""
    rows = await conn.fetch(DUE_SQL, limit)
    return [DueSaga(row["saga_id"], row["now"]) for row in rows]


class PostgresReaperStore:
    """Each call on a pooled connection of its own."""

    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float) -> None:
        self._pool = pool
        self._timeout_s = acquire_timeout_s

    async def expire_due(self, batch_size: int, reaper_id: str, outage_after_ms: int | None) -> list[Expiry]:
        async with connection(self._pool, self._timeout_s) as conn:
            return await expire_due(conn, batch_size, reaper_id, outage_after_ms)

    async def due_sagas(self, limit: int) -> list[DueSaga]:
        async with connection(self._pool, self._timeout_s) as conn:
            return await due_sagas(conn, limit)

    async def purge_keys(self, retention_s: int, batch: int) -> int:
        async with connection(self._pool, self._timeout_s) as conn:
            return await purge_expired(conn, retention_s, batch)

    async def purge_tickets(self, batch: int) -> int:
        async with connection(self._pool, self._timeout_s) as conn:
            status = await conn.execute(PURGE_TICKETS_SQL, batch)
        return int(status.split()[-1])

    async def create_partitions(self, interval: str, ahead: int) -> int:
        async with connection(self._pool, self._timeout_s) as conn:
            return int(await conn.fetchval("SELECT events_create_partitions($1, $2)", interval, ahead))
