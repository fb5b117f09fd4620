"""The projector runner on PostgreSQL: gap-safe against late commits, one application per page with
several runners, the service role's grants enough, lag on /metrics' gauge."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest
from prometheus_client import REGISTRY

from eventstore.dburl import asyncpg_dsn
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import Projector, build
from projections.replay import COVERED_SQL, LOG, PROJECTION, state_at
from service.projectors import ProjectorRunner

pytestmark = pytest.mark.storage

_INSERT = """INSERT INTO events (stream_id, stream_version, event_type, data, recorded_at)
             VALUES ($1, $2, 'LOCK_ACQUIRED', $3::jsonb, clock_timestamp()) RETURNING recorded_at"""


def _grant(owner: str, token: int, ttl_s: int = 600) -> str:
    return json.dumps(
        {"owner": owner, "fencing_token": token, "ttl_ms": ttl_s * 1000, "expires_at": "2999-01-01T00:00:00Z"}
    )


async def test_a_late_commit_is_applied_and_covered_only_after_it_commits(
    own_database: str, unique_prefix: str
) -> None:
    dsn = asyncpg_dsn(own_database)
    late, projector_conn = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        projector = Projector(HOLDING_PERIODS)
        await projector.catch_up(projector_conn)
        transaction = late.transaction()
        await transaction.start()
        recorded = await late.fetchval(_INSERT, f"{unique_prefix}late", 1, _grant("agv-late", 1))
        # Later transactions commit while the first is open: the projector applies none past it.
        await projector_conn.fetchval(_INSERT, f"{unique_prefix}early", 1, _grant("agv-early", 1))
        await asyncio.sleep(0.05)
        await projector.catch_up(projector_conn)
        held = await projector_conn.fetch(
            "SELECT resource FROM holding_periods WHERE starts_with(resource, $1)", unique_prefix
        )
        assert held == []
        covered = await projector_conn.fetchval(COVERED_SQL, HOLDING_PERIODS.name)
        assert covered is None or covered < recorded
        await transaction.commit()
        await projector.catch_up(projector_conn)
        held = await projector_conn.fetch(
            "SELECT resource FROM holding_periods WHERE starts_with(resource, $1) ORDER BY 1", unique_prefix
        )
        assert [r["resource"] for r in held] == [f"{unique_prefix}early", f"{unique_prefix}late"]
    finally:
        await late.close()
        await projector_conn.close()


async def test_runners_racing_apply_each_page_once_and_equal_a_build(
    own_database: str, own_service_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    dsn = asyncpg_dsn(own_database)
    writer = await asyncpg.connect(dsn)
    runners = [ProjectorRunner(own_service_pool, poll_s=0.01) for _ in range(3)]
    try:
        for runner in runners:
            runner.start()
        for i in range(300):
            await writer.fetchval(
                _INSERT, f"{unique_prefix}r{i % 37}", i // 37 + 1, _grant(f"agv-{i % 5}", i // 37 + 1)
            )
        last = await writer.fetchval("SELECT clock_timestamp()")
        for _ in range(400):  # a mark taken SETTLE after the last write covers it
            covered = await writer.fetchval(COVERED_SQL, HOLDING_PERIODS.name)
            if covered is not None and covered >= last:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the projectors did not cover the writes")
        rows = await writer.fetch(
            "SELECT * FROM holding_periods WHERE starts_with(resource, $1) ORDER BY 1, 2", unique_prefix
        )
        assert len(rows) == 300
        await writer.execute("CREATE TEMP TABLE shadow (LIKE holding_periods INCLUDING ALL)")
        await build(writer, HOLDING_PERIODS, "shadow")
        await writer.execute("DELETE FROM projector_checkpoints WHERE name = 'shadow'")
        built = await writer.fetch(
            "SELECT * FROM shadow WHERE starts_with(resource, $1) ORDER BY 1, 2", unique_prefix
        )
        assert [dict(r) for r in rows] == [dict(r) for r in built]
        projected = await state_at(writer, last, prefix=unique_prefix, limit=1000)
        logged = await state_at(writer, last, prefix=unique_prefix, limit=1000, use_projection=False)
        assert (projected.source, logged.source) == (PROJECTION, LOG)
        assert projected.locks == logged.locks
        assert len(logged.locks) == 37
        lag = REGISTRY.get_sample_value("lockledger_projector_lag_seconds", {"projector": "holding_periods"})
        assert lag is not None
        assert lag >= 0
    finally:
        for runner in runners:
            await runner.stop()
        await writer.close()


async def test_a_new_process_keeps_the_checkpoints_floor_so_it_never_reads_the_whole_log(
    own_database: str, unique_prefix: str
) -> None:
    """The floor under the checkpoint (a position below every event not yet applied) is what keeps each
    read of a window to the new events: a projector in a new process, whose tail has no marks yet, must
    not lower it to 0."""
    conn = await asyncpg.connect(asyncpg_dsn(own_database))
    try:
        for version in (1, 2, 3):
            await conn.fetchval(_INSERT, f"{unique_prefix}old", version, _grant("agv-old", version))
        floor = await conn.fetchval("SELECT max(position) FROM events")
        await conn.execute("TRUNCATE holding_periods")  # built afresh: the database is the module's
        await build(conn, HOLDING_PERIODS, floor=floor)
        await conn.fetchval(_INSERT, f"{unique_prefix}new", 1, _grant("agv-new", 1))
        await Projector(HOLDING_PERIODS).catch_up(conn)
        after = await conn.fetchval(
            "SELECT after FROM projector_checkpoints WHERE name = $1", "holding_periods"
        )
        assert after >= floor
        held = await conn.fetch(
            "SELECT DISTINCT resource FROM holding_periods WHERE starts_with(resource, $1) ORDER BY 1",
            unique_prefix,
        )
        assert [r["resource"] for r in held] == [f"{unique_prefix}new", f"{unique_prefix}old"]
    finally:
        await conn.close()
