"""A lease decided from memory (service/state_cache.py) on PostgreSQL: the renewal's statement stamps the
deadline into the log. How remembered states answer (stale memories, lapsed leases, retried keys, the
new-stream guess, three processes against a fresh read) is tested on the fakes:
tests/service/test_remembering.py."""

from __future__ import annotations

import json
from datetime import datetime

import asyncpg
import pytest

from domain.commands import Acquire, Release, Renew
from domain.resource import TtlBounds
from service.composition import lock_service_on_pool
from service.lock_service import CommandContext, LockService
from tests.assertions import granted

pytestmark = pytest.mark.storage

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)


def _service(pool: asyncpg.Pool) -> LockService:
    """A service with a memory of its own, as each server process has."""
    return lock_service_on_pool(pool, BOUNDS)


async def _events(pool: asyncpg.Pool, resource: str) -> list[tuple[str, dict[str, object]]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event_type, data FROM events WHERE stream_id = $1 ORDER BY stream_version", resource
        )
    return [(r["event_type"], json.loads(r["data"])) for r in rows]


async def test_a_lease_this_process_granted_is_renewed_and_released_without_reading(
    service_pool: asyncpg.Pool, resource: str
) -> None:
    service = _service(service_pool)
    acquired = await service.execute(Acquire(resource, "bot1", 30_000), CommandContext())
    token = granted(acquired).fencing_token
    await service.execute(Renew(resource, "bot1", token, 60_000), CommandContext())
    await service.execute(Release(resource, "bot1", token), CommandContext())
    assert service.reads == 0  # a new stream guessed new, then the remembered lease
    events = await _events(service_pool, resource)
    assert [t for t, _ in events] == ["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"]
    # The release carries the deadline the renewal's statement stamped, not the service's estimate.
    # Compared as instants: PostgreSQL writes the stamped one without trailing zeros (".98699"), Python's
    # isoformat keeps six digits (".986990").
    released_at, renewed_until = (datetime.fromisoformat(str(events[i][1]["expires_at"])) for i in (2, 1))
    assert released_at == renewed_until
    again = await service.execute(Acquire(resource, "bot2", 30_000), CommandContext())
    assert granted(again).fencing_token == 4
    assert service.reads == 0
