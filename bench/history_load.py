"""A year of synthetic fleet history, written straight into a fresh database (``python -m bench.history``).

The replay endpoints read the log alone, so measuring them at 1 M or 10 M events needs a log that size, and
appending it through the API would take hours. This writes it with COPY (asyncpg's
``copy_records_to_table``), in batches, generating each batch while the previous one is copied, so memory
stays flat whatever N. The result is what the service would have left:

- Agents (10,000) work in shifts spread evenly over a year, every agent busy during a shift: each takes a
  free resource out of R (100,000), renews it every ~10 s of synthetic time (each deadline its grant's
  ``recorded_at`` plus the TTL, each renew long before the previous deadline), then releases it (80 %),
  lets it lapse, the reaper recording ``LOCK_EXPIRED`` shortly after the deadline (15 %), or an admin
  force-releases it (5 %); then a short pause and the next lease. Streams run 1..n without gaps, a
  lease's fencing token is its ``LOCK_ACQUIRED``'s version, a resource has one holder at a time, and
  every lease has ended by the end of the history.
- Payloads and metadata are the service's, as it writes them (``domain/events.py``, the command statement
  and the reaper's, keys in jsonb's order): a grant's or the reaper's deadline as PostgreSQL renders a
  ``timestamptz`` in JSON (trailing zeros of the fraction dropped), a release's or force-release's as
  Python's ``isoformat`` (they carry the deadline the service read); every command carries an
  Idempotency-Key, as the SDK sends one; event ids are version-7 UUIDs of the synthetic instant.
- ``recorded_at`` strictly increases with ``position``; the history ends a day and an hour before now, so
  the Idempotency-Keys its commands carried have been purged, as the service's reaper would have.
- The hash chain is computed here with ``eventstore.verify.event_hash``, the triggers being off for the
  load session (``session_replication_role = replica``: a superuser's). The secondary indexes and unique
  constraints of ``events`` are dropped for the load and made again from their own definitions after it
  (an index built once is much cheaper than 10 M random inserts into it), then ``lock_state`` is rebuilt
  from the log (``projections/rebuild.py``), ``holding_periods`` and ``agent_stats`` with their
  checkpoints built as a rebuild builds them (``projections/projector.py`` ``build``), and the tables
  vacuumed and analyzed.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import psutil

from domain.events import LOCK_ACQUIRED, LOCK_EXPIRED, LOCK_FORCE_RELEASED, LOCK_RELEASED, LOCK_RENEWED
from domain.timestamps import format_timestamp
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import event_hash
from projections.agent_stats import AGENT_STATS
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import build
from projections.rebuild import rebuild_lock_state

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = 1_000_000

# How a lease goes: renews drawn uniformly in RENEWS, each RENEW_JITTER times the interval after the last
# grant; then one of the endings, by weight; then a pause of up to PAUSE renew intervals.
RENEWS = (0, 11)
RENEW_JITTER = (0.95, 1.05)
RELEASE, LAPSE, FORCE = "release", "lapse", "force"
ENDINGS = ((RELEASE, 0.80), (LAPSE, 0.15), (FORCE, 0.05))
RELEASE_AFTER = (0.05, 0.95)  # of a renew interval after the last grant
FORCE_AFTER = (0.05, 0.95)  # of the TTL after the last grant
REAPER_LATENESS_S = (0.005, 0.8)  # LOCK_EXPIRED after the deadline
PAUSE = 0.5  # renew intervals, at most, between an agent's leases
MIN_SHIFTS = 4  # a small history still spans the year
MAX_SHIFT_S = 300.0  # busy time per shift, about
SHIFT_GAP_S = 3_600.0  # at least this long between the end of a shift and the start of the next
FORCE_REASON = "stuck job"

COLUMNS = ("stream_id", "stream_version", "event_id", "event_type", "data", "metadata", "recorded_at", "hash")
Row = tuple[str, int, str, str, str, str, datetime, bytes]


@dataclass(frozen=True)
class HistoryShape:
    """What to write: N events of a fleet of ``agents`` over ``resources``, ending about ``end``."""

    events: int
    agents: int = 10_000
    resources: int = 100_000
    renew_s: float = 10.0
    ttl_ms: int = 30_000
    span_days: float = 365.0
    seed: int = 1
    end: datetime | None = None  # None: a day and an hour before now
    admin: str = "ops-admin"

    def __post_init__(self) -> None:
        if self.events < 2 or self.agents < 1 or self.resources <= self.agents:
            raise ValueError("needs at least 2 events, 1 agent and more resources than agents")
        if self.renew_s * RENEW_JITTER[1] >= self.ttl_ms / 1000:
            raise ValueError("agents must renew before their lease's deadline: renew_s < ttl")

    def resource(self, index: int) -> str:
        return f"fleet:{index // 1000:03d}:res-{index:06d}"

    def agent(self, index: int) -> str:
        return f"fleet-agent-{index:05d}"

    def lease_events(self) -> float:
        """A lease's events, on average: its acquire, its renews and its end."""
        return sum(RENEWS) / 2 + 2

    def cycle_s(self) -> float:
        """A lease and the pause after it, on average, in seconds."""
        ttl_s = self.ttl_ms / 1000
        weights = dict(ENDINGS)
        ending_s = (
            weights[RELEASE] * sum(RELEASE_AFTER) / 2 * self.renew_s
            + weights[LAPSE] * (ttl_s + sum(REAPER_LATENESS_S) / 2)
            + weights[FORCE] * sum(FORCE_AFTER) / 2 * ttl_s
        )
        return sum(RENEWS) / 2 * self.renew_s + ending_s + PAUSE / 2 * self.renew_s

    def shifts(self, end_us: int) -> list[tuple[int, int]]:
        """Each shift's start (µs since the epoch) and the events written by its end (cumulative): enough
        shifts of about MAX_SHIFT_S of busy fleet for N events, at least MIN_SHIFTS, spread evenly over
        the span, the last one ending about ``end``."""
        rate = self.agents * self.lease_events() / self.cycle_s()
        count = max(MIN_SHIFTS, math.ceil(self.events / (rate * MAX_SHIFT_S)))
        leases_per_agent = self.events / count / (self.agents * self.lease_events())
        # Long enough for the last lease of an agent that started late (the fleet starts over one interval).
        length_s = self.renew_s + (leases_per_agent + 1) * self.cycle_s() * 1.5 + self.ttl_ms / 1000
        last = end_us - int(length_s * _US)
        first = end_us - int(self.span_days * 86_400 * _US)
        spacing = (last - first) / (count - 1)
        if spacing < (length_s + SHIFT_GAP_S) * _US:
            raise ValueError(f"{count} shifts of about {length_s:.0f} s do not fit in {self.span_days} days")
        return [(first + round(i * spacing), self.events * (i + 1) // count) for i in range(count)]


def default_end() -> datetime:
    return datetime.now(UTC) - timedelta(days=1, hours=1)


def pg_json_instant(at: datetime) -> str:
    """A ``timestamptz`` as PostgreSQL writes it in JSON, in a UTC session: the fraction's trailing zeros
    dropped (``2026-05-05T09:30:00.25+00:00``), where Python's ``isoformat`` keeps six digits."""
    text = at.isoformat()
    return text if at.microsecond == 0 else text[:-6].rstrip("0") + text[-6:]


def _uuid_text(value: int) -> str:
    digits = f"{value:032x}"
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


_V4 = (0xF << 76, 0x4 << 76, 0x3 << 62, 0x2 << 62)  # version nibble and variant bits: clear, set


@dataclass(slots=True)
class _Lease:
    resource: int
    token: int
    renews_left: int
    ending: str
    granted_us: int  # the last grant's instant
    deadline: datetime


class _Fleet:
    """The simulation: every agent's next action in a heap by synthetic time, rows in time order.

    Each shift has its quota of events (cumulative, the last one N): a lease is planned whole when it is
    taken (its renews and its ending), so an agent takes one only if the events it will write fit in the
    quota, fewer renews if need be; an agent that cannot waits for the next shift. The history is then
    exactly N events, but for the rare case where one event is left over and no open lease can take
    one more renew (the report says how many were written)."""

    def __init__(self, shape: HistoryShape) -> None:
        self.shape = shape
        self.rng = random.Random(shape.seed)
        end = shape.end or default_end()
        self.shift_plan = shape.shifts((end - _EPOCH) // timedelta(microseconds=1))
        self.ttl = timedelta(milliseconds=shape.ttl_ms)
        self.resources = [shape.resource(i) for i in range(shape.resources)]
        self.agents = [shape.agent(i) for i in range(shape.agents)]
        self.versions = [0] * shape.resources
        self.hashes = [b""] * shape.resources
        self.busy: set[int] = set()  # resources with a lease not yet ended
        self.leases: list[_Lease | None] = [None] * shape.agents
        self.shift = [0] * shape.agents
        self.emitted = 0
        self.pending = 0  # events the open leases will still write
        self.last_us = 0
        self.heap: list[tuple[int, int]] = []
        for agent in range(shape.agents):
            self._join_shift(agent, 0)

    def _join_shift(self, agent: int, shift: int) -> None:
        if shift < len(self.shift_plan):
            self.shift[agent] = shift
            start = self.shift_plan[shift][0] + int(self.rng.uniform(0, self.shape.renew_s) * _US)
            heapq.heappush(self.heap, (start, agent))

    def _after(self, at_us: int, seconds: float, agent: int) -> None:
        heapq.heappush(self.heap, (at_us + int(seconds * _US), agent))

    def rows(self) -> Iterator[Row]:
        """Every event, in recorded_at order (strictly increasing), until the last shift's quota."""
        while self.heap:
            at_us, agent = heapq.heappop(self.heap)
            at_us = max(at_us, self.last_us + 1)
            lease = self.leases[agent]
            if lease is None:
                row = self._start(agent, at_us)
            elif lease.renews_left > 0:
                row = self._renew(agent, lease, at_us)
            else:
                row = self._end(agent, lease, at_us)
            if row is not None:
                self.last_us = at_us
                self.emitted += 1
                yield row

    def _start(self, agent: int, at_us: int) -> Row | None:
        rng = self.rng
        room = self.shift_plan[self.shift[agent]][1] - self.emitted - self.pending
        renews = min(rng.randint(*RENEWS), room - 2)
        if renews < 0:
            if room == 1 and self.shift[agent] == len(self.shift_plan) - 1:
                self._one_more_renew()
            self._join_shift(agent, self.shift[agent] + 1)
            return None
        resource = rng.randrange(self.shape.resources)
        while resource in self.busy:
            resource = rng.randrange(self.shape.resources)
        self.busy.add(resource)
        ending = rng.choices([e for e, _ in ENDINGS], [w for _, w in ENDINGS])[0]
        at = _EPOCH + timedelta(microseconds=at_us)
        lease = _Lease(resource, self.versions[resource] + 1, renews, ending, at_us, at + self.ttl)
        self.leases[agent] = lease
        self.pending += renews + 1
        self._next(agent, lease)
        return self._grant(LOCK_ACQUIRED, "acquire", agent, lease, at)

    def _one_more_renew(self) -> None:
        """Spend the last event of the history on a renew of a lease that has not had its last grant."""
        for lease in self.leases:
            if lease is not None and (lease.renews_left > 0 or lease.ending != LAPSE):
                lease.renews_left += 1
                self.pending += 1
                return

    def _renew(self, agent: int, lease: _Lease, at_us: int) -> Row:
        lease.renews_left -= 1
        self.pending -= 1
        at = _EPOCH + timedelta(microseconds=at_us)
        lease.granted_us = at_us
        lease.deadline = at + self.ttl
        self._next(agent, lease)
        return self._grant(LOCK_RENEWED, "renew", agent, lease, at)

    def _next(self, agent: int, lease: _Lease) -> None:
        """Schedule the agent's next action on ``lease``, from its last grant: renew or end."""
        rng, shape, at_us = self.rng, self.shape, lease.granted_us
        if lease.renews_left > 0:
            self._after(at_us, shape.renew_s * rng.uniform(*RENEW_JITTER), agent)
        elif lease.ending == RELEASE:
            self._after(at_us, shape.renew_s * rng.uniform(*RELEASE_AFTER), agent)
        elif lease.ending == FORCE:
            self._after(at_us, shape.ttl_ms / 1000 * rng.uniform(*FORCE_AFTER), agent)
        else:
            self._after(at_us, shape.ttl_ms / 1000 + rng.uniform(*REAPER_LATENESS_S), agent)

    def _end(self, agent: int, lease: _Lease, at_us: int) -> Row:
        owner = self.agents[agent]
        if lease.ending == LAPSE:
            event_type = LOCK_EXPIRED
            data = (
                f'{{"owner": "{owner}", "expires_at": "{pg_json_instant(lease.deadline)}", '
                f'"fencing_token": {lease.token}}}'
            )
            reaper = f"fleet-host:{20_000 + self.shift[agent]}"
            metadata = f'{{"actor": "reaper", "command": "expire", "reaper_id": "{reaper}"}}'
        elif lease.ending == FORCE:
            event_type = LOCK_FORCE_RELEASED
            data = (
                f'{{"owner": "{owner}", "reason": "{FORCE_REASON}", "expires_at": '
                f'"{lease.deadline.isoformat()}", "fencing_token": {lease.token}}}'
            )
            metadata = self._metadata(self.shape.admin, "force-release")
        else:
            event_type = LOCK_RELEASED
            data = (
                f'{{"owner": "{owner}", "expires_at": "{lease.deadline.isoformat()}", '
                f'"fencing_token": {lease.token}}}'
            )
            metadata = self._metadata(owner, "release")
        self.leases[agent] = None
        self.busy.discard(lease.resource)
        self.pending -= 1
        self._after(at_us, self.shape.renew_s * self.rng.uniform(0, PAUSE), agent)
        return self._row(lease.resource, event_type, data, metadata, _EPOCH + timedelta(microseconds=at_us))

    def _grant(self, event_type: str, command: str, agent: int, lease: _Lease, at: datetime) -> Row:
        owner = self.agents[agent]
        data = (
            f'{{"owner": "{owner}", "ttl_ms": {self.shape.ttl_ms}, '
            f'"expires_at": "{pg_json_instant(lease.deadline)}", "fencing_token": {lease.token}}}'
        )
        return self._row(lease.resource, event_type, data, self._metadata(owner, command), at)

    def _metadata(self, actor: str, command: str) -> str:
        clear_version, version, clear_variant, variant = _V4
        key = self.rng.getrandbits(128) & ~clear_version & ~clear_variant | version | variant
        return f'{{"actor": "{actor}", "command": "{command}", "idempotency_key": "{_uuid_text(key)}"}}'

    def _row(self, resource: int, event_type: str, data: str, metadata: str, at: datetime) -> Row:
        """The row as the append writes it: the stream's next version, a version-7 id of the instant,
        and the hash chained onto the stream's previous event."""
        stream = self.resources[resource]
        version = self.versions[resource] + 1
        self.versions[resource] = version
        micros = (at - _EPOCH) // timedelta(microseconds=1)
        ms, within = divmod(micros, 1000)
        stamp = ms << 16 | 0x7000 | within * 4096 // 1000
        event_id = _uuid_text(stamp << 64 | 1 << 63 | self.rng.getrandbits(62))
        digest = event_hash(self.hashes[resource], stream, version, event_id, event_type, data, metadata, at)
        self.hashes[resource] = digest
        return (stream, version, event_id, event_type, data, metadata, at, digest)


def generate(shape: HistoryShape, batch: int) -> Iterator[list[Row]]:
    """The history's rows in batches of ``batch``, in recorded_at order."""
    rows = _Fleet(shape).rows()
    while chunk := [row for _, row in zip(range(batch), rows, strict=False)]:
        yield chunk


@dataclass
class LoadReport:
    events: int
    streams: int
    first_recorded_at: datetime | None
    last_recorded_at: datetime | None
    seconds: float  # the whole load: rows, indexes, rebuilds, vacuum
    copy_seconds: float
    index_seconds: float
    rebuild_seconds: float
    projections_seconds: float
    vacuum_seconds: float
    lock_state_rows: int
    peak_rss_mb: float  # of this process while generating and copying
    database_mb: float

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0

    def record(self) -> dict[str, Any]:
        return {
            "events": self.events, "streams": self.streams,
            "first_recorded_at": _text(self.first_recorded_at),
            "last_recorded_at": _text(self.last_recorded_at),
            "seconds": round(self.seconds, 2), "events_per_s": round(self.events_per_s),
            "copy_seconds": round(self.copy_seconds, 2),
            "copy_events_per_s": round(self.events / self.copy_seconds) if self.copy_seconds else None,
            "index_seconds": round(self.index_seconds, 2), "rebuild_seconds": round(self.rebuild_seconds, 2),
            "projections_seconds": round(self.projections_seconds, 2),
            "vacuum_seconds": round(self.vacuum_seconds, 2), "lock_state_rows": self.lock_state_rows,
            "loader_peak_rss_mb": round(self.peak_rss_mb, 1), "database_mb": round(self.database_mb, 1),
        }  # fmt: skip


def _text(at: datetime | None) -> str | None:
    return None if at is None else format_timestamp(at)


# The definitions of what the load drops and makes again: unique constraints, and the indexes that back
# no constraint (the primary key stays: positions arrive in order).
_CONSTRAINTS_SQL = """
SELECT conname AS name, pg_get_constraintdef(oid) AS definition FROM pg_constraint
 WHERE conrelid = 'events'::regclass AND contype = 'u' ORDER BY conname"""
_INDEXES_SQL = """
SELECT c.relname AS name, pg_get_indexdef(i.indexrelid) AS definition
  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
 WHERE i.indrelid = 'events'::regclass
   AND NOT EXISTS (SELECT FROM pg_constraint k WHERE k.conindid = i.indexrelid)
 ORDER BY c.relname"""

# The heads the chain trigger would have kept (it is off for the load).
_HEADS_SQL = """
INSERT INTO stream_heads (stream_id, version, hash)
SELECT DISTINCT ON (stream_id) stream_id, stream_version, hash FROM events
 ORDER BY stream_id, stream_version DESC"""
_FIRST_PARTITION_SQL = """
SELECT min(substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''([^'']+)''\\)')::timestamptz)
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'events'::regclass"""


async def _partition_the_span(conn: asyncpg.Connection, since: datetime) -> None:
    """Monthly partitions of events (as the service makes them: migration 0010) from ``since``'s month
    up to the first partition the migration made, so the history lies where a year of service would
    have left it rather than in the default partition."""
    end = await conn.fetchval(_FIRST_PARTITION_SQL)
    lower = since.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    while lower < end:
        upper = min(end, (lower + timedelta(days=32)).replace(day=1))
        name = f"events_p{lower:%Y%m%d}"
        await conn.execute(
            f"CREATE TABLE {name} PARTITION OF events FOR VALUES FROM ('{lower.isoformat()}') TO"
            f" ('{upper.isoformat()}')"
        )
        for trigger, when in (("events_append_only", "UPDATE OR DELETE"), ("events_no_truncate", "TRUNCATE")):
            await conn.execute(
                f"CREATE TRIGGER {trigger} BEFORE {when} ON {name}"
                " FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change()"
            )
        await conn.execute(f"ALTER TABLE {name} OWNER TO lockledger_migrator")
        lower = upper


Progress = Callable[[int, float], None]  # events written so far, seconds since the start


async def load_history(
    database_url: str, shape: HistoryShape, progress: Progress | None = None, batch: int = 20_000
) -> LoadReport:
    """Write ``shape``'s history into the empty, migrated database at ``database_url`` (as a superuser)."""
    started = time.perf_counter()
    conn = await asyncpg.connect(asyncpg_dsn(database_url), server_settings={"timezone": "UTC"})
    try:
        if not await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
            raise PermissionError("the history is loaded with the triggers off, which takes a superuser")
        if await conn.fetchval("SELECT EXISTS (SELECT FROM events)"):
            raise ValueError("the events table is not empty: the history is loaded into a fresh database")
        constraints = await conn.fetch(_CONSTRAINTS_SQL)
        indexes = await conn.fetch(_INDEXES_SQL)
        await conn.execute("SET session_replication_role = replica")
        await conn.execute("SET synchronous_commit = off")
        for row in constraints:
            await conn.execute(f'ALTER TABLE events DROP CONSTRAINT "{row["name"]}"')
        for row in indexes:
            await conn.execute(f'DROP INDEX "{row["name"]}"')
        await _partition_the_span(conn, (shape.end or default_end()) - timedelta(days=shape.span_days))
        written, peak_rss = await _copy(conn, shape, batch, started, progress)
        copied = time.perf_counter()
        await conn.execute("SET session_replication_role = origin")
        await conn.execute("SET maintenance_work_mem = '256MB'")
        for row in constraints:
            await conn.execute(f'ALTER TABLE events ADD CONSTRAINT "{row["name"]}" {row["definition"]}')
        for row in indexes:
            # pg_get_indexdef names a partitioned index "ON ONLY events": made so, it would cover no
            # partition. Made on the table, it is built on every partition, as the migrations make it.
            await conn.execute(row["definition"].replace(" ON ONLY ", " ON ", 1))
        await conn.execute(_HEADS_SQL)
        indexed = time.perf_counter()
        lock_state_rows = await rebuild_lock_state(conn)
        rebuilt = time.perf_counter()
        # Nothing else writes to this database, so the last position is below every later event.
        last = await conn.fetchval("SELECT max(position) FROM events")
        # Statistics before the projections' joins (autovacuum never analyzes a partitioned table).
        await conn.execute("ANALYZE events")
        for projection in (HOLDING_PERIODS, AGENT_STATS):
            await build(conn, projection, floor=last)
        projected = time.perf_counter()
        await conn.execute("VACUUM (ANALYZE) events, lock_state, holding_periods, agent_stats")
        vacuumed = time.perf_counter()
        summary = await conn.fetchrow(
            "SELECT count(DISTINCT stream_id) AS streams, min(recorded_at) AS first,"
            " max(recorded_at) AS last, pg_database_size(current_database()) AS size FROM events"
        )
        assert summary is not None
    finally:
        await conn.close()
    return LoadReport(
        events=written,
        streams=summary["streams"],
        first_recorded_at=summary["first"],
        last_recorded_at=summary["last"],
        seconds=vacuumed - started,
        copy_seconds=copied - started,
        index_seconds=indexed - copied,
        rebuild_seconds=rebuilt - indexed,
        projections_seconds=projected - rebuilt,
        vacuum_seconds=vacuumed - projected,
        lock_state_rows=lock_state_rows,
        peak_rss_mb=peak_rss / 2**20,
        database_mb=summary["size"] / 2**20,
    )


async def _copy(
    conn: asyncpg.Connection, shape: HistoryShape, batch: int, started: float, progress: Progress | None
) -> tuple[int, int]:
    """COPY every batch, the next one generated (in a thread) while the last is copied; the rows written
    and the peak RSS of this process meanwhile."""
    batches = generate(shape, batch)
    me = psutil.Process()
    written = peak_rss = 0
    rows = await asyncio.to_thread(next, batches, None)
    while rows is not None:
        copying = asyncio.ensure_future(conn.copy_records_to_table("events", records=rows, columns=COLUMNS))
        following = asyncio.ensure_future(asyncio.to_thread(next, batches, None))
        await copying
        written += len(rows)
        peak_rss = max(peak_rss, me.memory_info().rss)
        if progress is not None:
            progress(written, time.perf_counter() - started)
        rows = await following
    return written, peak_rss
