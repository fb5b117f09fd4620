"""Fault 6: the projector outlives SIGKILLs of the service and a PostgreSQL crash without losing or doubling
an event.

A server runs the holding_periods projector under lock traffic on this package's private PostgreSQL; the
server is SIGKILLed and restarted, PostgreSQL is stopped immediately (recovering from the WAL) and
started again, the server SIGKILLed once more. Once the traffic ends and the projector has covered the
last event, holding_periods must be exactly the fold of the log written below (a row per grant: its
deadline, its lease's acquire, the stream's next event), and replay from it must equal replay from the
log at every event's instant.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from typing import Any

import asyncpg
import pytest

from eventstore.dburl import asyncpg_dsn
from projections.holding_periods import HOLDING_PERIODS
from projections.replay import COVERED_SQL, LOG, PROJECTION, state_at
from tests.faults.history import History
from tests.faults.load import MIN_ACKED, Load, LoadProfile
from tests.faults.postgres import PrivatePostgres
from tests.faults.processes import ServerFactory

pytestmark = [pytest.mark.storage, pytest.mark.slow]

GRANTS = ("LOCK_ACQUIRED", "LOCK_RENEWED")
_ROW_COLUMNS = (
    "resource", "grant_version", "owner", "fencing_token", "acquired_at", "saga_id", "saga_step",
    "granted_at", "expires_at", "ended_at", "ended_by",
)  # fmt: skip


def fold(events: list[asyncpg.Record]) -> list[tuple[Any, ...]]:
    """holding_periods as the log implies it, computed here independently of the projector's SQL."""
    by_key = {(e["stream_id"], e["stream_version"]): e for e in events}
    acquires = {
        (e["stream_id"], json.loads(e["data"])["fencing_token"]): e
        for e in events
        if e["event_type"] == "LOCK_ACQUIRED"
    }
    rows = []
    for e in events:
        if e["event_type"] not in GRANTS:
            continue
        data = json.loads(e["data"])
        acquire = acquires[(e["stream_id"], data["fencing_token"])]
        saga = json.loads(acquire["metadata"])
        following = by_key.get((e["stream_id"], e["stream_version"] + 1))
        rows.append((
            e["stream_id"], e["stream_version"], data["owner"], data["fencing_token"], acquire["recorded_at"],
            saga.get("saga_id"), saga.get("saga_step"), e["recorded_at"],
            datetime.fromisoformat(data["expires_at"]),
            None if following is None else following["recorded_at"],
            None if following is None else following["event_type"],
        ))  # fmt: skip
    return sorted(rows)


async def _events(conn: asyncpg.Connection, prefix: str) -> list[asyncpg.Record]:
    return list(
        await conn.fetch(
            "SELECT stream_id, stream_version, event_type, data::text AS data, metadata::text AS metadata,"
            " recorded_at FROM events WHERE starts_with(stream_id, $1) ORDER BY stream_id, stream_version",
            prefix,
        )
    )


async def _covered(conn: asyncpg.Connection, last: datetime, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        covered = await conn.fetchval(COVERED_SQL, HOLDING_PERIODS.name)
        if covered is not None and covered >= last:
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"the projector did not cover {last} within {timeout_s} s")


async def test_projector_survives_service_kills_and_a_postgres_crash(
    private_postgres: PrivatePostgres, unique_prefix: str, start_server: ServerFactory
) -> None:
    history = History()
    fast_projector = {"LOCKLEDGER_PROJECTOR_POLL_MS": "20"}
    server = start_server(private_postgres.url, fast_projector)
    resources = [f"{unique_prefix}lane{i}" for i in range(12)]
    async with Load(server.base_url, resources, history, LoadProfile(clients=24), seed=6):
        await asyncio.sleep(1.5)
        history.fault("sigkill_service")
        server.kill()
        await asyncio.to_thread(server.start)
        await asyncio.sleep(1.5)
        history.fault("postgres_stop_immediate")
        await asyncio.to_thread(private_postgres.stop_postmaster, "immediate")
        await asyncio.sleep(0.5)
        await asyncio.to_thread(private_postgres.start_postmaster)
        await asyncio.sleep(2.5)
        history.fault("sigkill_service")
        server.kill()
        await asyncio.to_thread(server.start)
        await asyncio.sleep(1.5)
    assert len(history.acked) > MIN_ACKED, "the load never got going"

    conn = await asyncpg.connect(asyncpg_dsn(private_postgres.url), server_settings={"timezone": "UTC"})
    try:
        events = await _events(conn, unique_prefix)
        while True:  # the reaper records the last leases' expiries after the load
            await _covered(conn, max(e["recorded_at"] for e in events))
            if len(latest := await _events(conn, unique_prefix)) == len(events):
                break
            events = latest
        projected = await conn.fetch(
            f"SELECT {', '.join(_ROW_COLUMNS)} FROM holding_periods WHERE starts_with(resource, $1)"
            " ORDER BY resource, grant_version",
            unique_prefix,
        )
        rows, folded = [tuple(row.values()) for row in projected], fold(events)
        differing = [(got, want) for got, want in zip(rows, folded, strict=False) if got != want]
        assert differing == []
        assert len(rows) == len(folded)
        assert sum(e["event_type"] == "LOCK_RENEWED" for e in events) > 10  # not vacuous
        for event in events[:: max(1, len(events) // 150)]:
            at = event["recorded_at"]
            from_log = await state_at(conn, at, prefix=unique_prefix, limit=1000, use_projection=False)
            projected_state = await state_at(conn, at, prefix=unique_prefix, limit=1000)
            assert (from_log.source, projected_state.source) == (LOG, PROJECTION)
            assert projected_state.locks == from_log.locks, at
    finally:
        await conn.close()
