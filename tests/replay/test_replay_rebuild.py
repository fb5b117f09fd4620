"""Replay reads the log and what is derived from it alone: rebuilding its indexes changes no answer, and
neither does emptying the lock_state projection."""

from __future__ import annotations

from datetime import datetime

import asyncpg
import pytest

from domain.commands import Acquire, Release
from projections.rebuild import REPLAY_INDEXES, rebuild_replay_indexes
from projections.replay import Change, LiveLease, StateAt, changes, state_at
from service.lock_service import CommandContext, LockService
from tests.assertions import granted

pytestmark = pytest.mark.storage


async def _answers(
    conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record], prefix: str, instants: list[datetime]
) -> list[tuple[int, list[LiveLease]] | list[Change]]:
    found: list[tuple[int, list[LiveLease]] | list[Change]] = []
    for at in instants:
        state: StateAt = await state_at(conn, at, prefix=prefix, limit=1000)
        found.append((state.position, state.locks))
    found.append((await changes(conn, instants[0], instants[-1], prefix=prefix, limit=1000)).changes)
    return found


async def test_rebuilt_indexes_and_an_empty_projection_change_no_answer(
    lock_service: LockService, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    instants: list[datetime] = [await admin_pool.fetchval("SELECT clock_timestamp()")]
    for index in range(6):
        resource = f"{unique_prefix}r{index}"
        lease = granted(
            await lock_service.execute(Acquire(resource, f"agv-{index}", 60_000), CommandContext())
        )
        instants.append(await admin_pool.fetchval("SELECT clock_timestamp()"))
        if index % 2 == 0:
            await lock_service.execute(Release(resource, lease.owner, lease.fencing_token), CommandContext())
            instants.append(await admin_pool.fetchval("SELECT clock_timestamp()"))
    async with admin_pool.acquire() as conn:
        before = await _answers(conn, unique_prefix, instants)
        assert any(isinstance(answer, tuple) and answer[1] for answer in before)  # not vacuous
        assert await rebuild_replay_indexes(conn) == REPLAY_INDEXES
        assert await _answers(conn, unique_prefix, instants) == before
        transaction = conn.transaction()
        await transaction.start()
        try:
            await conn.execute("DELETE FROM lock_state WHERE starts_with(resource, $1)", unique_prefix)
            assert await _answers(conn, unique_prefix, instants) == before
        finally:
            await transaction.rollback()
