"""Replay at any instant equals a fold of the events recorded up to it, written here independently.

Hypothesis writes lock histories on their own stretch of a synthetic past (decided by the pure decider,
appended with the instants it chose, deadlines that pass between events included), then asks
``state_at`` about instants before, between, at and after the events and deadlines, and compares with
the fold below: what was live at T, with the deadline known at T, when the lease was acquired and in
which reservation. Both
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
from projections.replay import LOG, PROJECTION, state_at
from tests.replay.histories import Logged, Step, steps, write_history

pytestmark = pytest.mark.storage

_DAYS = itertools.count()  # each example its own day of 1990, later examples on later days
_BASE = datetime(1990, 1, 1, tzinfo=UTC)


Lease = tuple[str, str, int, datetime, datetime, str | None]  # resource, ..., reservation


def _fold(logged: list[Logged], at: datetime) -> list[Lease]:
    """The leases live at ``at``: the last grant of each resource not ended since, deadline ahead."""
    leases: dict[str, Lease] = {}
    for event in logged:
        if event.recorded_at > at:
            continue
        deadline = datetime.fromisoformat(str(event.data["expires_at"]))
        token = int(str(event.data["fencing_token"]))
        if event.type in ("LOCK_ACQUIRED", "LOCK_HANDED_OFF"):  # a lease begins (and the giver's ends)
            owner, reservation = str(event.data["owner"]), event.metadata.get("reservation_id")
            leases[event.resource] = (event.resource, owner, token, event.recorded_at, deadline, reservation)
        elif event.type == "LOCK_RENEWED":
            resource, owner, _, acquired_at, _, reservation = leases[event.resource]
            leases[event.resource] = (resource, owner, token, acquired_at, deadline, reservation)
        else:
            leases.pop(event.resource, None)
    return sorted(lease for lease in leases.values() if lease[4] > at)


def _instants(logged: list[Logged], start: datetime) -> list[datetime]:
    """Before everything, at and just around each event and each deadline, and well after."""
    marks = [start - timedelta(seconds=1), start + timedelta(hours=1)]
    for event in logged:
        deadline = datetime.fromisoformat(str(event.data["expires_at"]))
        for instant in (event.recorded_at, deadline):
            marks += [instant - timedelta(microseconds=1), instant, instant + timedelta(microseconds=1)]
    return marks


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
            await Projector(HOLDING_PERIODS).catch_up(conn)
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
                )
                for lease in found.locks
            ]
            assert got == _fold(logged, at), at
            expected_position = await conn.fetchval(
                "SELECT coalesce(max(position), 0) FROM events WHERE recorded_at <= $1", at
            )
            assert found.position == expected_position, at
    finally:
        await conn.close()
