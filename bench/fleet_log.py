"""What the database says of a scenario: the events on its streams, the locks still held, and each
expiry's lateness (``recorded_at`` of LOCK_EXPIRED minus the deadline it carries).

Read as the schema owner, with a UTC session clock; every scenario's streams share a prefix that carries
the run id, so a reused database never mixes runs.
"""

from __future__ import annotations

import time
from typing import Any

import asyncpg

from bench.database import connect


async def connect_owner(database_url: str) -> asyncpg.Connection:
    """A connection as the URL's (schema-owning) user, UTC session clock."""
    return await connect(database_url, server_settings={"timezone": "UTC"})


def like_prefix(prefix: str) -> str:
    """A LIKE pattern for the names that start with ``prefix``."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


async def clock_offset_s(conn: asyncpg.Connection) -> float:
    """Database clock minus this machine's wall clock (about 0 on one host)."""
    before = time.time()
    db_now = float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8"))
    after = time.time()
    return db_now - (before + after) / 2


async def events_by_type(conn: asyncpg.Connection, prefix: str) -> dict[str, int]:
    rows = await conn.fetch(
        "SELECT event_type, count(*) AS n FROM events WHERE stream_id LIKE $1 GROUP BY event_type",
        like_prefix(prefix),
    )
    return {str(row["event_type"]): int(row["n"]) for row in rows}


async def expiries_before_deadline(conn: asyncpg.Connection, prefix: str) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM events WHERE stream_id LIKE $1 AND event_type = 'LOCK_EXPIRED' "
            "AND recorded_at < (data->>'expires_at')::timestamptz",
            like_prefix(prefix),
        )
    )


async def held(conn: asyncpg.Connection, prefix: str) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM lock_state WHERE resource LIKE $1 AND status = 'held'", like_prefix(prefix)
        )
    )


LATENESS_SQL = """
WITH e AS (
    SELECT recorded_at, (data->>'expires_at')::timestamptz AS deadline, metadata->>'actor' AS actor
      FROM events
     WHERE stream_id LIKE $1 AND event_type = 'LOCK_EXPIRED'
), l AS (
    SELECT *, extract(epoch FROM recorded_at - deadline)::float8 AS late FROM e
)
SELECT count(*) AS expired,
       count(*) FILTER (WHERE actor = 'reaper') AS by_reaper,
       percentile_disc(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY late) AS pct,
       max(late) AS max_late,
       min(late) AS min_late,
       count(*) FILTER (WHERE late > 1) AS over_1s,
       count(*) FILTER (WHERE late > $2) AS over_10s,
       extract(epoch FROM max(recorded_at) - max(deadline))::float8 AS last_deadline_to_last_expiry,
       extract(epoch FROM max(recorded_at) - min(recorded_at))::float8 AS expiry_span,
       extract(epoch FROM max(recorded_at))::float8 AS last_expiry_epoch
  FROM l
"""

PEAK_RATE_SQL = """
SELECT coalesce(max(n), 0) FROM (
    SELECT count(*) AS n FROM events
     WHERE stream_id LIKE $1 AND event_type = 'LOCK_EXPIRED'
     GROUP BY date_trunc('second', recorded_at)
) per_second
"""


async def lateness(conn: asyncpg.Connection, prefix: str, limit_s: float) -> dict[str, Any]:
    """How late the expiries on ``prefix`` were recorded: percentiles, extremes, how many after 1 s and
    after ``limit_s`` (``over_10s``), and the reaper's mean and peak rate."""
    row = await conn.fetchrow(LATENESS_SQL, like_prefix(prefix), limit_s)
    assert row is not None
    peak = int(await conn.fetchval(PEAK_RATE_SQL, like_prefix(prefix)))
    pct = row["pct"] or [None, None, None]
    expired = int(row["expired"])
    span = row["expiry_span"]

    def r(value: float | None) -> float | None:
        return None if value is None else round(float(value), 4)

    return {
        "expired": expired,
        "by_reaper": int(row["by_reaper"]),
        "p50_s": r(pct[0]),
        "p95_s": r(pct[1]),
        "p99_s": r(pct[2]),
        "max_s": r(row["max_late"]),
        "min_s": r(row["min_late"]),
        "over_1s": int(row["over_1s"]),
        "over_10s": int(row["over_10s"]),
        "last_deadline_to_last_expiry_s": r(row["last_deadline_to_last_expiry"]),
        "mean_rate_per_s": round(expired / span, 1) if span else None,
        "peak_rate_per_s": peak,
        "last_expiry_epoch": row["last_expiry_epoch"],
    }
