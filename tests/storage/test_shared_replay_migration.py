"""Migration 0018 writes holding_periods rows for the shared-lock grants logged before it: after a
downgrade (which drops them with their columns) and the upgrade, the table equals what the projector
wrote with the columns in place, mutex rows and shared rows alike."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from alembic import command

from eventstore.connection import Connection
from eventstore.dburl import asyncpg_dsn
from migrations.upgrade import alembic_config, upgrade
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import Projector
from tests.databases import catch_up_past_writes
from tests.replay.histories import write_history

pytestmark = pytest.mark.storage

_ROWS = "SELECT * FROM holding_periods ORDER BY resource, grant_version"
# A mutex and the semaphore of the same name (r0, limit 2): two permits, one renewed then released, one
# left to lapse; a writer on r1's read/write lock after a reader released.
_STORY = [
    (10, 0, "acquire", 0, 2_500), (10, 0, "read", 1, 2_500), (10, 0, "read", 2, 1_000),
    (10, 0, "s-renew", 1, 2_500), (10, 0, "s-release", 1, 2_500), (10, 1, "read", 0, 1_000),
    (10, 1, "s-release", 0, 1_000), (10, 1, "write", 2, 2_500), (3_000, 0, "s-expire", 0, 1_000),
]  # fmt: skip


async def _rows(conn: Connection) -> list[dict[str, Any]]:
    return [dict(row) for row in await conn.fetch(_ROWS)]


async def test_migration_0018_writes_the_rows_of_earlier_shared_grants(scratch_database_url: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(scratch_database_url), server_settings={"timezone": "UTC"})
    try:
        await write_history(conn, "m:", datetime(1993, 1, 1, tzinfo=UTC), _STORY)
        await catch_up_past_writes(conn, Projector(HOLDING_PERIODS))
        written = await _rows(conn)
        shared = [(row["resource"], row["mode"], row["lock_limit"]) for row in written if row["mode"]]
        assert shared == [
            ("shared/m:r0", "shared", 2), ("shared/m:r0", "shared", 2), ("shared/m:r0", "shared", 2),
            ("shared/m:r1", "shared", None), ("shared/m:r1", "exclusive", None),
        ]  # fmt: skip

        await asyncio.to_thread(command.downgrade, alembic_config(scratch_database_url), "0017")
        assert len(await conn.fetch(_ROWS)) == len(written) - len(shared)  # the mutex rows stay
        await asyncio.to_thread(upgrade, scratch_database_url)  # alembic's env runs an event loop of its own
        assert await _rows(conn) == written
    finally:
        await conn.close()
