"""No lease lapses because nobody could reach the database: after an outage, live leases are extended.

etcd's rule, kept here: "no lease expires due to server side unavailability". While no writable primary
answers (a failover, a restart, every lockledger instance down), no holder can renew, so a lease whose
deadline passed meanwhile did not lapse through its holder's fault. Every running instance writes a
*beacon* (one row, ``outage_beacon``) once a ``beacon_interval_ms``; a gap in it longer than
``outage_after_ms`` is an outage. The first instance to write the beacon after one extends every lease
still held whose deadline was after the last beacon by the gap, appending a ``LOCK_RENEWED`` per lease
with ``metadata.command = "extend"`` and the outage's bounds: it is in the log, in history and replay, and
the holder keeps its fencing token. A saga's own lease live when the gap began starts again at the end of
it (``SAGA_LEASE_EXTENDED``), so the reaper's saga pass does not take a saga from an orchestrator that
could not heartbeat. A shared lock's live grants are extended as leases are (``SHARED_RENEWED``). It
runs under the beacon's row lock and each lease's row lock, so two instances never extend twice and a
command that committed first is seen.

An instance that met an unreachable database, or has just started, is *suspect*: before its next command
or reaper pass reaches the database it writes the beacon itself (``resume_if_needed``), so no lease that
lapsed during an outage is taken over or expired before it is extended. ``outage_after_ms`` must be at
least twice the beacon interval: an outage that no instance's beacon noticed is then too short to count.
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass
from datetime import datetime

import asyncpg
import structlog
from prometheus_client import Counter

from domain.events import LOCK_RENEWED
from domain.saga import SAGA_LEASE_EXTENDED, STREAM_PREFIX
from domain.shared_lock import SHARED_RENEWED
from domain.shared_lock import STREAM_PREFIX as SHARED_PREFIX
from domain.timestamps import format_timestamp
from eventstore.connection import Connection
from eventstore.event_ids import event_id_sql
from eventstore.payloads import build_payload_sql, timestamp_text_sql
from service.config import Settings
from service.database_guard import is_unreachable
from service.stopping import pause_unless_stopped

log = structlog.get_logger("lockledger.outage")

OUTAGES_TOTAL = Counter("lockledger_outages_total", "Outages after which this process extended live leases")
EXTENDED_TOTAL = Counter("lockledger_leases_extended_total", "Leases extended after an outage")

# The most a beat may take: its extension included, whatever the command path's timeouts.
BEAT_TIMEOUT_S = 60.0

BEAT_SQL = """
INSERT INTO outage_beacon AS b (id, beat_at, beaten_by) VALUES (1, clock_timestamp(), $1)
ON CONFLICT (id) DO UPDATE SET beat_at = clock_timestamp(), beaten_by = excluded.beaten_by
"""

# The previous beat and the database's clock, holding the beacon's row lock until the transaction ends.
LAST_BEAT_SQL = "SELECT beat_at, clock_timestamp() AS now FROM outage_beacon WHERE id = 1 FOR UPDATE"

_RENEWED_PAYLOAD = build_payload_sql(
    LOCK_RENEWED, owner="owner", fencing_token="fencing_token", expires_at="new_expires_at", ttl_ms="ttl_ms"
)

# The outage an extension covers, in its event's metadata: from the last beat ($1) to the clock now (ts).
_OUTAGE_BOUNDS = (
    f"'outage_from', {timestamp_text_sql('$1::timestamptz')}, 'outage_to', {timestamp_text_sql('ts')}"
)

# Every lease still held whose deadline was after the last beat ($1) gets the outage ($1 to the clock now)
# added to its deadline: one LOCK_RENEWED each, and the projection row, in one statement.
EXTEND_SQL = f"""
WITH now AS (SELECT clock_timestamp() AS ts),
live AS (
    SELECT resource, version, owner, fencing_token, ttl_ms, expires_at
      FROM lock_state
     WHERE status = 'held' AND expires_at > $1::timestamptz
       FOR UPDATE
),
stamped AS (
    SELECT live.*, ts, expires_at + (ts - $1::timestamptz) AS new_expires_at
      FROM live, now
),
appended AS (
    INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata, recorded_at)
    SELECT resource, version + 1, {event_id_sql("ts")}, '{LOCK_RENEWED}', {_RENEWED_PAYLOAD},
           jsonb_build_object(
               'command', 'extend', 'actor', 'lockledger', 'reason', 'outage', 'instance', $2::text,
               {_OUTAGE_BOUNDS},
               'outage_ms', round(extract(epoch FROM ts - $1::timestamptz) * 1000)::bigint
           ),
           ts
      FROM stamped
 RETURNING stream_id
),
projected AS (
    UPDATE lock_state AS s
       SET version = st.version + 1, expires_at = st.new_expires_at, updated_at = st.ts
      FROM stamped AS st
     WHERE s.resource = st.resource
 RETURNING s.resource
)
SELECT (SELECT count(*) FROM projected) AS extended, (SELECT ts FROM now) AS ts
"""


# Every unfinished saga whose lease was live at the last beat ($1) gets a new lease from now (the deadline
# every append of a saga stamps): one SAGA_LEASE_EXTENDED each, and the saga_state row, in one statement.
EXTEND_SAGAS_SQL = f"""
WITH now AS (SELECT clock_timestamp() AS ts),
live AS (
    SELECT saga_id, version, lease_ms
      FROM saga_state
     WHERE lease_expires_at IS NOT NULL AND lease_expires_at > $1::timestamptz
       FOR UPDATE
),
stamped AS (
    SELECT live.*, ts FROM live, now
),
appended AS (
    INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata, recorded_at)
    SELECT '{STREAM_PREFIX}' || saga_id, version + 1, {event_id_sql("ts")}, '{SAGA_LEASE_EXTENDED}',
           '{{}}'::jsonb,
           jsonb_build_object(
               'command', 'extend', 'actor', 'lockledger', 'reason', 'outage', 'instance', $2::text,
               'saga_id', saga_id, {_OUTAGE_BOUNDS},
               'outage_ms', round(extract(epoch FROM ts - $1::timestamptz) * 1000)::bigint
           ),
           ts
      FROM stamped
 RETURNING stream_id
),
projected AS (
    UPDATE saga_state AS s
       SET version = st.version + 1, lease_expires_at = st.ts + st.lease_ms * interval '1 millisecond',
           updated_at = st.ts
      FROM stamped AS st
     WHERE s.saga_id = st.saga_id
 RETURNING s.saga_id
)
SELECT count(*) FROM projected
"""


# Every shared-lock grant live at the last beat ($1) gets the outage added to its deadline, as a mutex lease
# does: one SHARED_RENEWED per grant (a lock's grants at consecutive versions, in token order), the grants'
# rows and the lock's head, in one statement under each head's row lock. Its clock ($3) is the leases'
# extension's, so every lease and grant is extended by the same gap.
EXTEND_SHARED_SQL = f"""
WITH now AS (SELECT $3::timestamptz AS ts),
heads AS (
    SELECT h.resource, h.version FROM shared_locks AS h
     WHERE EXISTS (SELECT 1 FROM shared_holders AS g
                    WHERE g.resource = h.resource AND g.expires_at > $1::timestamptz)
     ORDER BY h.resource
       FOR UPDATE
),
stamped AS (
    SELECT g.resource, g.fencing_token, g.owner, g.ttl_ms, heads.version, now.ts,
           g.expires_at + (now.ts - $1::timestamptz) AS new_expires_at,
           row_number() OVER (PARTITION BY g.resource ORDER BY g.fencing_token) AS n,
           count(*) OVER (PARTITION BY g.resource) AS grants
      FROM shared_holders AS g JOIN heads USING (resource) CROSS JOIN now
     WHERE g.expires_at > $1::timestamptz
),
appended AS (
    INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata, recorded_at)
    SELECT '{SHARED_PREFIX}' || resource, version + n, {event_id_sql("ts")}, '{SHARED_RENEWED}',
           jsonb_build_object('owner', owner, 'fencing_token', fencing_token,
                              'expires_at', {timestamp_text_sql("new_expires_at")}, 'ttl_ms', ttl_ms),
           jsonb_build_object(
               'command', 'extend', 'actor', 'lockledger', 'reason', 'outage', 'instance', $2::text,
               {_OUTAGE_BOUNDS},
               'outage_ms', round(extract(epoch FROM ts - $1::timestamptz) * 1000)::bigint
           ),
           ts
      FROM stamped
     ORDER BY resource, n
 RETURNING stream_id
),
renewed AS (
    UPDATE shared_holders AS g SET expires_at = st.new_expires_at
      FROM stamped AS st
     WHERE g.resource = st.resource AND g.fencing_token = st.fencing_token
 RETURNING 1
),
moved AS (
    UPDATE shared_locks AS h SET version = h.version + st.grants, updated_at = st.ts
      FROM (SELECT DISTINCT resource, grants, ts FROM stamped) AS st
     WHERE h.resource = st.resource
 RETURNING 1
)
SELECT count(*) FROM renewed
"""


def _retrieve(task: asyncio.Future[None]) -> None:
    """A beat's failure is its waiters' to see; none may be left waiting, so it is read here too."""
    if not task.cancelled():
        task.exception()


def instance_id() -> str:
    """This process, as the log and the beacon name it: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, slots=True)
class Outage:
    """An interval with no beacon: from the last beat before it to the beat that ended it."""

    began: datetime
    ended: datetime
    leases_extended: int
    saga_leases_extended: int = 0
    shared_grants_extended: int = 0


async def beat(conn: Connection, instance: str, outage_after_ms: int) -> Outage | None:
    """Write the beacon; when the last beat is older than ``outage_after_ms``, extend the live leases
    first and return the outage. One transaction: the beacon's row lock orders concurrent beats."""
    async with conn.transaction():
        # An extension appends one event per live lease: with many thousands it outlasts the command
        # path's statement timeout, and cut off it would only start again at the next beat.
        await conn.execute(f"SET LOCAL statement_timeout = {int(BEAT_TIMEOUT_S * 1000)}")
        row = await conn.fetchrow(LAST_BEAT_SQL)
        outage = None
        if row is not None and (row["now"] - row["beat_at"]).total_seconds() * 1000 > outage_after_ms:
            extended = await conn.fetchrow(EXTEND_SQL, row["beat_at"], instance)
            assert extended is not None  # an aggregate always answers one row
            sagas = await conn.fetchval(EXTEND_SAGAS_SQL, row["beat_at"], instance)
            shared = await conn.fetchval(EXTEND_SHARED_SQL, row["beat_at"], instance, extended["ts"])
            outage = Outage(
                row["beat_at"], extended["ts"], int(extended["extended"]), int(sagas), int(shared)
            )
        await conn.execute(BEAT_SQL, instance)
    return outage


class OutageWatch:
    """This process's beacon, and its suspicion that the database was unreachable since the last beat."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        instance: str,
        *,
        interval_ms: int,
        outage_after_ms: int,
        timeout_s: float,
    ) -> None:
        if outage_after_ms < 2 * interval_ms:
            raise ValueError("outage_after_ms must be at least twice the beacon interval")
        self._pool = pool
        self.instance = instance
        self._interval_s = interval_ms / 1000
        self._outage_after_ms = outage_after_ms
        self._timeout_s = timeout_s
        self._suspect = True  # until the first beat: the process may have started after an outage
        self._beating = asyncio.Lock()
        self._resuming: asyncio.Future[None] | None = None
        self._stop = asyncio.Event()

    @classmethod
    def for_settings(cls, pool: asyncpg.Pool, settings: Settings) -> OutageWatch:
        return cls(
            pool,
            instance_id(),
            interval_ms=settings.beacon_interval_ms,
            outage_after_ms=settings.outage_after_ms,
            timeout_s=settings.command_timeout_s,
        )

    def saw_failure(self, error: BaseException) -> None:
        """Note an error from the database: an unreachable one makes the next round trip beat first."""
        if is_unreachable(error):
            self._suspect = True

    async def resume_if_needed(self) -> None:
        """Beat now if the database may have been unreachable since the last beat (one beat at a time;
        concurrent callers wait for it). A caller waits at most twice the round-trip timeout and then
        fails as an unreachable database does (503), while the beat, an extension of many leases
        perhaps, goes on to its end: cut off, it would only start over."""
        if not self._suspect:
            return
        if self._resuming is None or self._resuming.done():
            self._resuming = asyncio.ensure_future(self._beat_if_suspect())
            self._resuming.add_done_callback(_retrieve)
        async with asyncio.timeout(2 * self._timeout_s):
            await asyncio.shield(self._resuming)

    async def _beat_if_suspect(self) -> None:
        async with self._beating:
            if self._suspect:
                await self.beat()

    async def beat(self) -> Outage | None:
        try:
            async with asyncio.timeout(self._timeout_s):
                conn = await self._pool.acquire()
        except BaseException:
            self._suspect = True
            raise
        try:
            async with asyncio.timeout(BEAT_TIMEOUT_S):
                outage = await beat(conn, self.instance, self._outage_after_ms)
        except BaseException:
            # Closed, not returned: a beat cut off mid-transaction (the database frozen) would make the
            # pool's reset wait for the database, and with it this process's next beat.
            self._suspect = True
            conn.terminate()
            await self._pool.release(conn)
            raise
        await self._pool.release(conn)
        self._suspect = False
        if outage is not None:
            OUTAGES_TOTAL.inc()
            EXTENDED_TOTAL.inc(outage.leases_extended)
            log.warning(
                "leases extended after an outage",
                outage_from=format_timestamp(outage.began),
                outage_to=format_timestamp(outage.ended),
                outage_ms=round((outage.ended - outage.began).total_seconds() * 1000),
                leases=outage.leases_extended,
                saga_leases=outage.saga_leases_extended,
                shared_grants=outage.shared_grants_extended,
            )
        return outage

    async def run(self) -> None:
        """Beat every interval until stopped; a failed beat only leaves the process suspect."""
        failing = False
        while not self._stop.is_set():
            try:
                async with self._beating:
                    await self.beat()
                failing = False
            except Exception as error:  # the database is unreachable or refused: try again next interval
                if not failing:
                    log.warning("beacon not written; the next command beats first", error=repr(error))
                failing = True
            await pause_unless_stopped(self._stop, self._interval_s)

    def stop(self) -> None:
        self._stop.set()
