"""Replay at any instant equals a fold of the events recorded up to it, written here independently.

Hypothesis writes lock histories on their own stretch of a synthetic past (decided by the pure decider,
appended with the instants it chose, deadlines that pass between events included), then asks
``state_at`` about instants before, between, at and after the events and deadlines, and compares with
the fold below: what was live at T, with the deadline known at T, when the lease was acquired and in
which reservation, and each shared-lock grant live at T with its mode and limit (after the mutex of the
same name, by token). Both
ways of answering are held to it: the log, and holding_periods once its projector has caught up.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings

from eventstore.dburl import asyncpg_dsn
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import Projector
from projections.replay import LOG, PROJECTION, LiveLease, state_at
from tests.databases import catch_up_past_writes
from tests.replay.histories import Logged, Step, steps, write_history

pytestmark = pytest.mark.storage

_DAYS = itertools.count()  # each example its own day of 1990, later examples on later days
_BASE = datetime(1990, 1, 1, tzinfo=UTC)


# resource, owner, token, acquired, deadline, reservation, mode, limit
Lease = tuple[str, str, int, datetime, datetime, str | None, str | None, int | None]
_SHARED = "shared/"


def _fold(logged: list[Logged], at: datetime) -> list[Lease]:
    """The leases live at ``at``: the last grant of each resource not ended since, deadline ahead; and of
    each shared lock, each grant not released or expired since, its last deadline ahead."""
    leases: dict[tuple[str, int], Lease] = {}  # by stream, and token for a shared lock's (0 for a mutex)
    for event in logged:
        if event.recorded_at > at:
            continue
        deadline = datetime.fromisoformat(str(event.data["expires_at"]))
        token = int(str(event.data["fencing_token"]))
        owner, reservation = str(event.data["owner"]), event.metadata.get("reservation_id")
        shared = event.resource.startswith(_SHARED)
        key = (event.resource, token if shared else 0)
        if event.type == "SHARED_ACQUIRED":
            limit = event.data["limit"]
            leases[key] = (
                event.resource.removeprefix(_SHARED), owner, token, event.recorded_at, deadline, reservation,
                str(event.data["mode"]), None if limit is None else int(str(limit)),
            )  # fmt: skip
        elif event.type in ("LOCK_ACQUIRED", "LOCK_HANDED_OFF"):  # a lease begins (and the giver's ends)
            leases[key] = (event.resource, owner, token, event.recorded_at, deadline, reservation, None, None)
        elif event.type in ("LOCK_RENEWED", "SHARED_RENEWED"):
            leases[key] = (*leases[key][:4], deadline, *leases[key][5:])
        else:  # the lease or grant ends
            leases.pop(key, None)
    live = [lease for lease in leases.values() if lease[4] > at]
    return sorted(live, key=lambda lease: (lease[0], lease[6] is not None, lease[2]))


def _instants(logged: list[Logged], start: datetime) -> list[datetime]:
    """Before everything, at and just around each event and each deadline, and well after."""
    marks = [start - timedelta(seconds=1), start + timedelta(hours=1)]
    for event in logged:
        deadline = datetime.fromisoformat(str(event.data["expires_at"]))
        for instant in (event.recorded_at, deadline):
            marks += [instant - timedelta(microseconds=1), instant, instant + timedelta(microseconds=1)]
    return marks


async def _paged(conn: asyncpg.Connection, at: datetime, prefix: str, source: str) -> list[LiveLease]:
    """The leases live at ``at``, two a page, following the cursor (a shared grant's: resource/token)."""
    leases: list[LiveLease] = []
    cursor = None
    while True:
        page = await state_at(
            conn, at, prefix=prefix, cursor=cursor, limit=2, use_projection=source == PROJECTION
        )
        leases += page.locks
        if page.next_cursor is None:
            return leases
        cursor = page.next_cursor


@pytest.mark.parametrize("source", [LOG, PROJECTION])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(story=steps)
async def test_replay_equals_a_fold_of_the_log(
    own_database: str, unique_prefix: str, story: list[Step], source: str
) -> None:
    start = _BASE + timedelta(days=next(_DAYS))
    prefix = f"{unique_prefix}{start:%j}:"
    conn = await asyncpg.connect(asyncpg_dsn(own_database), server_settings={"timezone": "UTC"})
    try:
        logged = await write_history(conn, prefix, start, story)
        if source == PROJECTION:
            await catch_up_past_writes(conn, Projector(HOLDING_PERIODS))
        for at in _instants(logged, start):
            found = await state_at(conn, at, prefix=prefix, limit=1000, use_projection=source == PROJECTION)
            assert found.source == source
            got = [
                (
                    lease.resource,
                    lease.owner,
                    lease.fencing_token,
                    lease.acquired_at,
                    lease.expires_at,
                    lease.reservation_id,
                    lease.mode,
                    lease.limit,
                )
                for lease in found.locks
            ]
            assert got == _fold(logged, at), at
            assert await _paged(conn, at, prefix, source) == found.locks, at
            held = await state_at(conn, at, prefix=prefix, owner="agv-1", use_projection=source == PROJECTION)
            assert held.locks == [lease for lease in found.locks if lease.owner == "agv-1"], at
            expected_position = await conn.fetchval(
                "SELECT coalesce(max(position), 0) FROM events WHERE recorded_at <= $1", at
            )
            assert found.position == expected_position, at
    finally:
        await conn.close()
