"""The database guard's stall watchdog: once a round trip outlives its timeout, new ones fail at once."""

from __future__ import annotations

import asyncio

import pytest

from service.database_guard import DatabaseGuard
from service.errors import Unavailable


async def test_a_stalled_round_trip_makes_new_ones_fail_fast() -> None:
    guard = DatabaseGuard(stall_s=0.2)
    frozen = asyncio.Event()

    async def hang() -> None:
        await frozen.wait()  # a server that never answers

    async def answer() -> str:
        return "ok"

    stuck = asyncio.create_task(guard.run(hang))
    await asyncio.sleep(0.05)
    assert await guard.run(answer) == "ok"  # slow is not stalled yet
    await asyncio.sleep(0.2)
    asked = False

    async def must_not_run() -> str:
        nonlocal asked
        asked = True
        return "asked"

    with pytest.raises(Unavailable) as refused:
        await guard.run(must_not_run)
    assert not asked  # refused without a round trip
    assert refused.value.retry_after_s == 1
    assert guard.stalled_for() > 0

    frozen.set()  # the server answers again
    await stuck
    assert guard.stalled_for() == 0
    assert await guard.run(answer) == "ok"


async def test_without_a_stall_bound_nothing_is_refused() -> None:
    guard = DatabaseGuard()
    frozen = asyncio.Event()
    stuck = asyncio.create_task(guard.run(frozen.wait))
    await asyncio.sleep(0.05)
    assert guard.stalled_for() == 0
    frozen.set()
    assert await stuck is True


async def test_a_failed_round_trip_leaves_no_stall_behind() -> None:
    guard = DatabaseGuard(stall_s=0.01)

    async def fail() -> None:
        raise OSError("connection refused")

    with pytest.raises(OSError, match="refused"):
        await guard.run(fail)
    await asyncio.sleep(0.02)
    assert guard.stalled_for() == 0
