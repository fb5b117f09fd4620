"""The changes' pages cross grants of one shared lock that lapse at the same instant: each lapse is on
exactly one page, in token order, whatever the page size."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from domain.shared_lock import SHARED, SharedAcquired, shared_event_payload
from eventstore.dburl import asyncpg_dsn
from projections.replay import LEASE_LAPSED, Change, changes
from tests.replay.histories import append_event

pytestmark = pytest.mark.storage


@pytest.mark.parametrize("limit", [1, 2, 5])
async def test_lapses_at_one_instant_page_once_each(
    own_database: str, unique_prefix: str, limit: int
) -> None:
    start = datetime(1994, 1, 1, tzinfo=UTC) + timedelta(days=limit)
    deadline = start + timedelta(seconds=10)
    stream = f"shared/{unique_prefix}{limit}:bay"
    conn = await asyncpg.connect(asyncpg_dsn(own_database), server_settings={"timezone": "UTC"})
    try:
        for token in (1, 2, 3):  # three permits, acquired a second apart, all lapsing at `deadline`
            at = start + timedelta(seconds=token)
            ttl_ms = (deadline - at) // timedelta(milliseconds=1)
            grant = SharedAcquired(stream, f"agv-{token}", SHARED, 4, token, ttl_ms, deadline)
            await append_event(conn, stream, token, grant.type, shared_event_payload(grant), {}, at)
        seen: list[Change] = []
        cursor = None
        while True:
            page = await changes(
                conn, start, deadline, prefix=f"{unique_prefix}{limit}:", cursor=cursor, limit=limit
            )
            seen += page.changes
            if (cursor := page.next_cursor) is None:
                break
    finally:
        await conn.close()
    assert [(change.type, change.fencing_token) for change in seen] == [
        ("SHARED_ACQUIRED", 1), ("SHARED_ACQUIRED", 2), ("SHARED_ACQUIRED", 3),
        (LEASE_LAPSED, 3), (LEASE_LAPSED, 2), (LEASE_LAPSED, 1),
    ]  # fmt: skip
    assert {change.resource for change in seen} == {stream}
