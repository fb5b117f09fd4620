"""holding_periods kept by its projector equals the table built from the log at once, and re-applying
events, in any order and any number of times, changes nothing.

The histories are those of ``histories.py`` (decided by the pure decider, appended with chosen
instants), each on its own stretch of the past and its own resources.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventstore.connection import Connection
from eventstore.dburl import asyncpg_dsn
from projections import checkpoints, holding_periods
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import Projector, build
from tests.databases import catch_up_past_writes
from tests.replay.histories import Step, steps, write_history

pytestmark = pytest.mark.storage

_GRANTS = ("LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_HANDED_OFF", "SHARED_ACQUIRED", "SHARED_RENEWED")
_DAYS = itertools.count()
_BASE = datetime(1991, 1, 1, tzinfo=UTC)
_ROWS = """SELECT * FROM {table} WHERE starts_with(resource, $1) OR starts_with(resource, 'shared/' || $1)
            ORDER BY resource, grant_version"""


async def _rows(conn: Connection, table: str, prefix: str) -> list[dict[str, Any]]:
    return [dict(row) for row in await conn.fetch(_ROWS.format(table=table), prefix)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(story=steps, replays=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 8)), max_size=6))
async def test_projected_equals_built_and_reapplying_changes_nothing(
    own_database: str, unique_prefix: str, story: list[Step], replays: list[tuple[int, int]]
) -> None:
    start = _BASE + timedelta(days=next(_DAYS))
    prefix = f"{unique_prefix}{start:%j}:"
    conn = await asyncpg.connect(asyncpg_dsn(own_database), server_settings={"timezone": "UTC"})
    try:
        logged = await write_history(conn, prefix, start, story)
        await catch_up_past_writes(
            conn, Projector(HOLDING_PERIODS, page=7)
        )  # small pages: windows read in parts
        projected = await _rows(conn, HOLDING_PERIODS.name, prefix)
        grants = [e for e in logged if e.type in _GRANTS]
        assert len(projected) == len(grants)  # not vacuous: a row per grant, a shared lock's too
        # Each row names the reservation its lease was begun in (its acquire's or hand-off's metadata),
        # and a shared grant's its mode and limit (its acquire's).
        begun = {
            (e.resource, e.data["fencing_token"]): (
                e.metadata.get("reservation_id"), e.data.get("mode"), e.data.get("limit"),
            )
            for e in logged
            if e.type in ("LOCK_ACQUIRED", "LOCK_HANDED_OFF", "SHARED_ACQUIRED")
        }  # fmt: skip
        assert [(row["reservation_id"], row["mode"], row["lock_limit"]) for row in projected] == [
            begun[(row["resource"], row["fencing_token"])] for row in projected
        ]

        # Any slice of the log applied again, newest first, changes nothing.
        keys = [(e.resource, e.version) for e in logged]
        for offset, length in replays:
            chosen = keys[offset % max(len(keys), 1) :][:length]
            await holding_periods.apply(conn, HOLDING_PERIODS.name, list(reversed(chosen)))
        assert await _rows(conn, HOLDING_PERIODS.name, prefix) == projected

        # Built from scratch in one statement: the same rows.
        await conn.execute("CREATE TEMP TABLE shadow (LIKE holding_periods INCLUDING ALL)")
        built = await build(conn, HOLDING_PERIODS, "shadow")
        assert await _rows(conn, "shadow", prefix) == projected
        assert (await checkpoints.load(conn, "shadow")) == built
        await conn.execute("DELETE FROM projector_checkpoints WHERE name = 'shadow'; DROP TABLE shadow")
    finally:
        await conn.close()
