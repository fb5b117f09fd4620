"""Replay at any instant equals a fold of the events recorded up to it, written here independently.

Hypothesis writes lock histories on their own stretch of a synthetic past (decided by the pure decider,
appended with the instants it chose, deadlines that pass between events included), then asks
``state_at`` about instants before, between, at and after the events and deadlines, and compares with
the fold below: what was live at T, with the deadline known at T and when the lease was acquired. Both
ways of answering are held to it: the log, and holding_periods once its projector has caught up.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain.commands import Acquire, Command, Expire, ForceRelease, Release, Renew
from domain.decider import decide, evolve
from domain.errors import DomainError
from domain.events import event_payload, stamp
from domain.state import LockState, initial_state
from eventstore.connection import Connection
from eventstore.dburl import asyncpg_dsn
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import Projector
from projections.replay import LOG, PROJECTION, state_at

pytestmark = pytest.mark.storage

_DAYS = itertools.count()  # each example its own day of 1990, later examples on later days
_BASE = datetime(1990, 1, 1, tzinfo=UTC)

Step = tuple[int, int, str, int, int]  # gap ms, resource, command, owner, ttl ms
steps = st.lists(
    st.tuples(
        st.integers(0, 3_000),
        st.integers(0, 2),
        st.sampled_from(["acquire", "renew", "release", "expire", "force"]),
        st.integers(0, 2),
        st.sampled_from([200, 1_000, 2_500]),
    ),
    min_size=1,
    max_size=30,
)


@dataclass
class Logged:
    position: int
    resource: str
    version: int
    type: str
    data: dict[str, object]
    recorded_at: datetime


def _command(kind: str, resource: str, owner: str, ttl_ms: int, state: LockState) -> Command:
    if kind == "acquire":
        return Acquire(resource, owner, ttl_ms)
    if kind == "renew":
        return Renew(resource, state.owner or owner, state.fencing_token, ttl_ms)
    if kind == "release":
        return Release(resource, state.owner or owner, state.fencing_token)
    if kind == "expire":
        return Expire(resource)
    return ForceRelease(resource, "hypothesis")


async def write_history(conn: Connection, prefix: str, start: datetime, story: list[Step]) -> list[Logged]:
    states = {i: initial_state(f"{prefix}r{i}") for i in range(3)}
    now = start
    logged: list[Logged] = []
    for gap_ms, index, kind, owner, ttl_ms in story:
        now += timedelta(milliseconds=gap_ms, microseconds=1)
        state = states[index]
        try:
            events = stamp(
                decide(state, _command(kind, state.resource, f"agv-{owner}", ttl_ms, state), now), now
            )
        except DomainError:
            continue
        for event in events:
            state = evolve(state, event)
            data = event_payload(event)
            position = await conn.fetchval(
                """INSERT INTO events (stream_id, stream_version, event_type, data, recorded_at)
                   VALUES ($1, $2, $3, $4::jsonb, $5) RETURNING position""",
                state.resource, state.version, event.type, json.dumps(data), now,
            )  # fmt: skip
            logged.append(Logged(position, state.resource, state.version, event.type, data, now))
        states[index] = state
    return logged


def _fold(logged: list[Logged], at: datetime) -> list[tuple[str, str, int, datetime, datetime]]:
    """The leases live at ``at``: the last grant of each resource not ended since, deadline ahead."""
    leases: dict[str, tuple[str, int, datetime, datetime]] = {}
    for event in logged:
        if event.recorded_at > at:
            continue
        deadline = datetime.fromisoformat(str(event.data["expires_at"]))
        token = int(str(event.data["fencing_token"]))
        if event.type == "LOCK_ACQUIRED":
            leases[event.resource] = (str(event.data["owner"]), token, event.recorded_at, deadline)
        elif event.type == "LOCK_RENEWED":
            owner, _, acquired_at, _ = leases[event.resource]
            leases[event.resource] = (owner, token, acquired_at, deadline)
        else:
            leases.pop(event.resource, None)
    return sorted(
        (resource, owner, token, acquired_at, deadline)
        for resource, (owner, token, acquired_at, deadline) in leases.items()
        if deadline > at
    )


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
                (lease.resource, lease.owner, lease.fencing_token, lease.acquired_at, lease.expires_at)
                for lease in found.locks
            ]
            assert got == _fold(logged, at), at
            expected_position = await conn.fetchval(
                "SELECT coalesce(max(position), 0) FROM events WHERE recorded_at <= $1", at
            )
            assert found.position == expected_position, at
    finally:
        await conn.close()
