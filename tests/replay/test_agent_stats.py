"""agent_stats kept by its projector equals a fold of the log written here, and a build from scratch.

The histories are those of ``histories.py``, each on resources of its own zone.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings

from eventstore.dburl import asyncpg_dsn
from projections.agent_stats import AGENT_STATS
from projections.projector import Projector, build
from tests.databases import catch_up_past_writes
from tests.replay.histories import Logged, Step, steps, write_history

pytestmark = pytest.mark.storage

_DAYS = itertools.count()
_BASE = datetime(1992, 1, 1, tzinfo=UTC)
_ENDINGS = ("LOCK_RELEASED", "LOCK_EXPIRED", "LOCK_FORCE_RELEASED")
_ROWS = "SELECT owner, zone, holds, ended, held_ms, lapses FROM {table} WHERE zone = $1 ORDER BY owner"


def fold(logged: list[Logged], zone: str) -> list[tuple[str, str, int, int, int, int]]:
    """Per owner: leases taken, leases ended, milliseconds held by the ended ones, lapses."""
    acquired: dict[tuple[str, int], datetime] = {}
    stats: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for event in logged:
        owner, token = str(event.data["owner"]), int(str(event.data["fencing_token"]))
        if event.type == "LOCK_HANDED_OFF":  # the giver's lease ends at the hand-off
            giver, given = str(event.data["from_owner"]), int(str(event.data["from_token"]))
            stats[giver][1] += 1
            stats[giver][2] += (event.recorded_at - acquired[(event.resource, given)]) // timedelta(
                milliseconds=1
            )
        if event.type in ("LOCK_ACQUIRED", "LOCK_HANDED_OFF"):
            acquired[(event.resource, token)] = event.recorded_at
            stats[owner][0] += 1
        elif event.type in _ENDINGS:
            deadline = datetime.fromisoformat(str(event.data["expires_at"]))
            ended = min(event.recorded_at, deadline)
            stats[owner][1] += 1
            stats[owner][2] += (ended - acquired[(event.resource, token)]) // timedelta(milliseconds=1)
            stats[owner][3] += event.type == "LOCK_EXPIRED"
    return sorted((owner, zone, *counts) for owner, counts in stats.items())  # type: ignore[misc]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(story=steps)
async def test_projected_stats_equal_a_fold_and_a_build(
    own_database: str, unique_prefix: str, story: list[Step]
) -> None:
    start = _BASE + timedelta(days=next(_DAYS))
    zone = f"{unique_prefix}{start:%j}"
    conn = await asyncpg.connect(asyncpg_dsn(own_database), server_settings={"timezone": "UTC"})
    try:
        logged = await write_history(conn, f"{zone}:", start, story)
        await catch_up_past_writes(conn, Projector(AGENT_STATS, page=5))
        projected = [tuple(r.values()) for r in await conn.fetch(_ROWS.format(table="agent_stats"), zone)]
        assert projected == fold(logged, zone)
        await conn.execute("CREATE TEMP TABLE built (LIKE agent_stats INCLUDING ALL)")
        await build(conn, AGENT_STATS, "built")
        await conn.execute("DELETE FROM projector_checkpoints WHERE name = 'built'")
        assert [tuple(r.values()) for r in await conn.fetch(_ROWS.format(table="built"), zone)] == projected
        await conn.execute("DROP TABLE built")
    finally:
        await conn.close()
