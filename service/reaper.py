"""The reaper: expires leases whose holders stopped heartbeating, and purges old Idempotency-Keys.

Each pass is one statement that picks due leases with ``FOR UPDATE SKIP LOCKED`` (so several reapers
share the work without waiting on each other) and re-checks the deadline on the locked row, so a renew
that committed first wins and is never expired. Expiry appends ``LOCK_EXPIRED`` exactly as the decider
would (domain.decide(Expire)), set-wise for throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime

import asyncpg
import structlog
from prometheus_client import Counter, Histogram

from domain.events import LOCK_EXPIRED
from eventstore.connection import Connection
from eventstore.payloads import build_payload_sql
from projections.lock_state import lapsed_sql
from service.config import Settings
from service.database import connection
from service.idempotency import purge_expired

log = structlog.get_logger("lockledger.reaper")

EXPIRED_TOTAL = Counter("lockledger_leases_expired_total", "Leases expired by the reaper")
EXPIRY_LATENESS = Histogram(
    "lockledger_expiry_lateness_seconds",
    "Time from a lease's deadline to its LOCK_EXPIRED event",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
KEYS_PURGED_TOTAL = Counter("lockledger_idempotency_keys_purged_total", "Idempotency-Keys purged")

# LOCK_EXPIRED's payload from the lapsed lease's row, as domain.decide(Expire) would write it.
_EXPIRED_PAYLOAD = build_payload_sql(
    LOCK_EXPIRED, owner="owner", fencing_token="fencing_token", expires_at="expires_at"
)

EXPIRE_DUE_SQL = f"""
WITH due AS (
    SELECT resource, version, owner, fencing_token, expires_at
      FROM lock_state
     WHERE status = 'held' AND {lapsed_sql("expires_at", "clock_timestamp()")}
     ORDER BY expires_at
     LIMIT $1::integer
       FOR UPDATE SKIP LOCKED
),
stamped AS (
    SELECT due.*, clock_timestamp() AS ts FROM due
),
appended AS (
    INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata, recorded_at)
    SELECT resource, version + 1,
           -- A version-7 id stamped with the expiry's millisecond, as eventstore/event_ids.py makes for
           -- every other event, so a burst of expiries appends at the end of the unique index on event_id
           -- rather than on random leaves. PostgreSQL 15 has no uuidv7(): a random (version-4) uuid
           -- with the millisecond over its first 48 bits and its version nibble 4 turned to 7 (bits 52
           -- and 53 of the bytes, counted from each byte's low end).
           encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
                  PLACING substring(int8send(floor(extract(epoch FROM ts) * 1000)::bigint) FROM 3)
                  FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid,
           '{LOCK_EXPIRED}',
           {_EXPIRED_PAYLOAD},
           jsonb_build_object('command', 'expire', 'actor', 'reaper', 'reaper_id', $2::text),
           ts
      FROM stamped
 RETURNING stream_id
),
projected AS (
    UPDATE lock_state AS s
       SET version = st.version + 1, status = 'free', ended_by = '{LOCK_EXPIRED}', updated_at = st.ts
      FROM stamped AS st
     WHERE s.resource = st.resource
 RETURNING s.resource
)
SELECT resource, fencing_token, expires_at, ts FROM stamped
"""


@dataclass(frozen=True, slots=True)
class Expiry:
    resource: str
    fencing_token: int
    deadline: datetime
    expired_at: datetime

    @property
    def lateness_s(self) -> float:
        return (self.expired_at - self.deadline).total_seconds()


def default_reaper_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def expire_due(conn: Connection, batch_size: int, reaper_id: str) -> list[Expiry]:
    """One pass: expire up to ``batch_size`` lapsed leases in one transaction."""
    rows = await conn.fetch(EXPIRE_DUE_SQL, batch_size, reaper_id)
    expiries = [Expiry(r["resource"], r["fencing_token"], r["expires_at"], r["ts"]) for r in rows]
    for expiry in expiries:
        EXPIRY_LATENESS.observe(max(expiry.lateness_s, 0.0))
    EXPIRED_TOTAL.inc(len(expiries))
    return expiries


class Reaper:
    """Runs passes until stopped; sleeps only when a pass found less than a full batch."""

    def __init__(self, pool: asyncpg.Pool, settings: Settings, reaper_id: str | None = None) -> None:
        self._pool = pool
        self._settings = settings
        self.reaper_id = reaper_id or default_reaper_id()
        self._stop = asyncio.Event()
        self.expired_count = 0
        self._next_purge = 0.0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        log.info("reaper started", reaper_id=self.reaper_id, batch=self._settings.reaper_batch_size)
        while not self._stop.is_set():
            try:
                found = await self.run_once()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as error:
                log.warning("reaper pass failed; retrying", error=str(error))
                found = 0
            if found < self._settings.reaper_batch_size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self._settings.reaper_interval_ms / 1000)
        log.info("reaper stopped", reaper_id=self.reaper_id, expired=self.expired_count)

    async def run_once(self) -> int:
        async with connection(self._pool, self._settings.pool_acquire_timeout_s) as conn:
            expiries = await expire_due(conn, self._settings.reaper_batch_size, self.reaper_id)
            if expiries:
                self.expired_count += len(expiries)
                log.info(
                    "leases expired",
                    count=len(expiries),
                    max_lateness_ms=round(max(e.lateness_s for e in expiries) * 1000, 1),
                )
            if time.monotonic() >= self._next_purge:
                purged = await purge_expired(
                    conn, self._settings.idempotency_retention_s, self._settings.idempotency_purge_batch
                )
                KEYS_PURGED_TOTAL.inc(purged)
                # Keep purging without pause while there is a backlog; otherwise look again in 10 s.
                self._next_purge = (
                    0.0 if purged >= self._settings.idempotency_purge_batch else time.monotonic() + 10
                )
        return len(expiries)
