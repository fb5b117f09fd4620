"""Rebuilding holding_periods beside the live table while writes and the live projector go on: the switch
keeps every row, the grants and the index names, and the live runner carries on with the new table."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest

from eventstore.dburl import asyncpg_dsn
from projections import checkpoints
from projections.holding_periods import HOLDING_PERIODS
from projections.projection_rebuild import rebuild_projection
from projections.projector import build
from service.projectors import ProjectorRunner

pytestmark = pytest.mark.storage

_INSERT = """INSERT INTO events (stream_id, stream_version, event_type, data, recorded_at)
             VALUES ($1, $2, 'LOCK_ACQUIRED', $3::jsonb, clock_timestamp())"""
_ROWS = "SELECT * FROM {table} WHERE starts_with(resource, $1) ORDER BY resource, grant_version"


async def _write(conn: asyncpg.Connection, prefix: str, start: int, count: int) -> None:
    for i in range(start, start + count):
        data = {
            "owner": f"agv-{i % 7}",
            "fencing_token": 1,
            "ttl_ms": 1000,
            "expires_at": "2999-01-01T00:00:00Z",
        }
        await conn.execute(_INSERT, f"{prefix}r{i}", 1, json.dumps(data))


async def test_rebuild_switches_to_an_equal_table_while_the_live_one_serves(
    own_database: str, own_service_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(own_database), server_settings={"timezone": "UTC"})
    runner = ProjectorRunner(own_service_pool, poll_s=0.01)
    runner.start()
    try:
        await _write(conn, unique_prefix, 0, 200)
        writing = asyncio.create_task(
            _write(conn_2 := await asyncpg.connect(asyncpg_dsn(own_database)), unique_prefix, 200, 200)
        )
        switched = await rebuild_projection(conn, HOLDING_PERIODS, page=50)
        await writing
        await conn_2.close()
        assert switched.name == HOLDING_PERIODS.name
        assert await checkpoints.load(conn, "holding_periods_next") is None
        for _ in range(200):  # the live runner, its checkpoint moved by the switch, carries on
            count = await conn.fetchval(
                "SELECT count(*) FROM holding_periods WHERE starts_with(resource, $1)", unique_prefix
            )
            if count == 400:
                break
            await asyncio.sleep(0.05)
        rows = [dict(r) for r in await conn.fetch(_ROWS.format(table="holding_periods"), unique_prefix)]
        await conn.execute("CREATE TEMP TABLE fresh (LIKE holding_periods INCLUDING ALL)")
        await build(conn, HOLDING_PERIODS, "fresh")
        await conn.execute("DELETE FROM projector_checkpoints WHERE name = 'fresh'")
        assert rows == [dict(r) for r in await conn.fetch(_ROWS.format(table="fresh"), unique_prefix)]
        assert len(rows) == 400
        indexes = {
            r["indexname"]
            for r in await conn.fetch("SELECT indexname FROM pg_indexes WHERE tablename = 'holding_periods'")
        }
        assert indexes == {"holding_periods_pkey", "holding_periods_valid_idx"}
        readable = await conn.fetchval(
            "SELECT has_table_privilege('lockledger_readonly', 'holding_periods', 'SELECT')"
        )
        writable = await conn.fetchval(
            "SELECT has_table_privilege('lockledger_service', 'holding_periods', 'UPDATE')"
        )
        assert (readable, writable) == (True, True)
    finally:
        await runner.stop()
        await conn.close()
