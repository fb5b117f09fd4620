"""Migration 0017 names the reservations of leases taken before it: lock_state and holding_periods rows
after the migration equal the rows the inline projection and the projector wrote with the column in
place (a reserved lease names its reservation; a single acquire, and a lease handed off from a reserved
one, name none)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest
from alembic import command

from domain.commands import Acquire, HandOff
from domain.reservation import Reserve
from domain.resource import TtlBounds
from eventstore.connection import Connection
from eventstore.dburl import asyncpg_dsn
from migrations.upgrade import alembic_config, upgrade
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import Projector
from service.composition import lock_service_on_pool, reservation_service_on_pool
from service.config import Settings
from service.database import create_pool
from service.lock_service import CommandContext
from service.reservation_service import Reservation
from tests.databases import catch_up_past_writes

pytestmark = pytest.mark.storage

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)
_ROWS = {
    "lock_state": "SELECT * FROM lock_state ORDER BY resource",
    "holding_periods": "SELECT * FROM holding_periods ORDER BY resource, grant_version",
}


async def _rows(conn: Connection) -> dict[str, list[dict[str, Any]]]:
    return {table: [dict(row) for row in await conn.fetch(sql)] for table, sql in _ROWS.items()}


async def test_migration_0017_fills_the_reservation_of_earlier_leases(scratch_database_url: str) -> None:
    pool = await create_pool(Settings(database_url=scratch_database_url, reaper_enabled=False))
    locks = lock_service_on_pool(pool, BOUNDS)
    try:
        reservations = reservation_service_on_pool(pool, locks, BOUNDS)
        ctx = CommandContext()
        reserved = await reservations.execute(Reserve("trip-1", ("zone:A1", "zone:A2"), "agv-1", 60_000), ctx)
        assert isinstance(reserved.outcome, Reservation)
        await locks.execute(Acquire("dock:1", "agv-3", 60_000), ctx)
        token = {lease.resource: lease.fencing_token for lease in reserved.outcome.leases}["zone:A2"]
        await locks.execute(HandOff("zone:A2", "agv-1", token, "agv-2", 60_000), ctx)
    finally:
        await locks.close()
        await pool.close()
    conn = await asyncpg.connect(asyncpg_dsn(scratch_database_url), server_settings={"timezone": "UTC"})
    try:
        await catch_up_past_writes(conn, Projector(HOLDING_PERIODS))
        written = await _rows(conn)
        named = {(row["resource"], row["reservation_id"]) for row in written["lock_state"]}
        assert named == {("dock:1", None), ("zone:A1", "trip-1"), ("zone:A2", None)}
        periods = [(row["resource"], row["reservation_id"]) for row in written["holding_periods"]]
        assert periods == [("dock:1", None), ("zone:A1", "trip-1"), ("zone:A2", "trip-1"), ("zone:A2", None)]

        await asyncio.to_thread(command.downgrade, alembic_config(scratch_database_url), "0015")
        await asyncio.to_thread(upgrade, scratch_database_url)  # alembic's env runs an event loop of its own
        assert await _rows(conn) == written
    finally:
        await conn.close()
