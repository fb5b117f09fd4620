"""``bench/history_load.py``: a synthetic history written by COPY is one the service could have written.

A few thousand events are loaded into a database of their own (the loader needs an empty events table),
then checked against what the service keeps: every chain verifies, streams run 1..n, each lease is
acquired, renewed before its deadline, and ended (released or force-released before the deadline, expired
after it), tokens increase, one holder at a time, payloads and metadata in the service's shapes, and
``lock_state`` is what the decider folds from the log. Then the service itself carries on from it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from bench.database import execute, replace_database
from bench.history_load import HistoryShape, LoadReport, load_history, pg_json_instant
from domain.commands import Acquire
from domain.decider import fold
from domain.events import (
    GRANTING_EVENTS,
    LOCK_ACQUIRED,
    LOCK_EXPIRED,
    LOCK_FORCE_RELEASED,
    LOCK_RELEASED,
    LOCK_RENEWED,
    PAYLOAD_FIELDS,
    event_from_payload,
)
from domain.state import initial_state
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import verify_chains
from migrations.upgrade import upgrade
from projections import checkpoints
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import Projector, initial_checkpoint
from projections.rebuild import rebuild_lock_state
from projections.schema import lock_state_from_row
from service.composition import lock_service_on_pool
from service.config import Settings
from service.database import create_pool
from service.lock_service import CommandContext
from service.outcomes import Granted

pytestmark = pytest.mark.storage

SHAPE = HistoryShape(events=3_000, agents=40, resources=400, span_days=30, seed=7)
COMMANDS = {
    LOCK_ACQUIRED: "acquire",
    LOCK_RENEWED: "renew",
    LOCK_RELEASED: "release",
    LOCK_FORCE_RELEASED: "force-release",
}


@pytest.fixture(scope="module")
async def loaded(database_url: str) -> AsyncIterator[tuple[str, LoadReport]]:
    """A fresh database on the test server, with SHAPE's history loaded into it."""
    name = f"lockledger_history_{uuid.uuid4().hex[:8]}"
    await execute(database_url, f'CREATE DATABASE "{name}"')
    url = replace_database(database_url, name)
    try:
        await asyncio.to_thread(upgrade, url)  # runs its own event loop
        yield url, await load_history(url, SHAPE, batch=700)  # several batches
    finally:
        await execute(database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _connect(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(asyncpg_dsn(url), server_settings={"timezone": "UTC"})


async def _events(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(
        await conn.fetch(
            "SELECT position, stream_id, stream_version, event_type, data::text AS data,"
            " metadata::text AS metadata, recorded_at FROM events ORDER BY stream_id, stream_version"
        )
    )


async def test_the_log_is_n_events_whose_chains_verify(loaded: tuple[str, LoadReport]) -> None:
    url, report = loaded
    conn = await _connect(url)
    try:
        verified = await verify_chains(conn)
        counts = await conn.fetchrow(
            "SELECT count(*) AS events, max(position) AS last, count(DISTINCT stream_id) AS streams"
            " FROM events"
        )
        gaps = await conn.fetchval(
            "SELECT count(*) FROM (SELECT stream_id FROM events GROUP BY stream_id"
            " HAVING min(stream_version) <> 1 OR max(stream_version) <> count(*)) AS s"
        )
        backwards = await conn.fetchval(
            "SELECT count(*) FROM (SELECT recorded_at <= lag(recorded_at) OVER (ORDER BY position) AS back"
            " FROM events) AS e WHERE back"
        )
        triggers = await conn.fetch(
            "SELECT tgname, tgenabled FROM pg_trigger WHERE tgrelid = 'events'::regclass"
        )
    finally:
        await conn.close()
    assert verified.ok, verified.broken
    assert verified.events == report.events == SHAPE.events
    assert counts is not None
    assert (counts["events"], counts["last"]) == (SHAPE.events, SHAPE.events)  # positions 1..N
    assert counts["streams"] == report.streams == report.lock_state_rows
    assert gaps == 0
    assert backwards == 0  # recorded_at strictly increases with position
    assert {row["tgname"]: row["tgenabled"] for row in triggers} == {
        "events_chain_hash": b"O",
        "events_append_only": b"O",
        "events_no_truncate": b"O",
    }  # on again after the load
    assert report.first_recorded_at is not None
    assert report.last_recorded_at is not None
    assert report.last_recorded_at < datetime.now(UTC) - timedelta(days=1)  # keys purged by now
    assert report.last_recorded_at - report.first_recorded_at > timedelta(days=SHAPE.span_days * 0.9)


def _check_payload(event: asyncpg.Record, data: dict[str, Any], metadata: dict[str, Any]) -> None:
    kind = event["event_type"]
    assert list(data) == sorted(PAYLOAD_FIELDS[kind], key=lambda f: (len(f), f))  # jsonb's order
    parsed = event_from_payload(event["stream_id"], kind, data)
    deadline = datetime.fromisoformat(data["expires_at"])
    # The command statement and the reaper write a deadline in SQL; release and force-release in Python.
    written_by_sql = kind in GRANTING_EVENTS or kind == LOCK_EXPIRED
    assert data["expires_at"] == (pg_json_instant(deadline) if written_by_sql else deadline.isoformat())
    if kind == LOCK_EXPIRED:
        assert set(metadata) == {"actor", "command", "reaper_id"}
        assert (metadata["actor"], metadata["command"]) == ("reaper", "expire")
    else:
        assert set(metadata) == {"actor", "command", "idempotency_key"}
        assert metadata["command"] == COMMANDS[kind]
        assert metadata["actor"] == (SHAPE.admin if kind == LOCK_FORCE_RELEASED else parsed.owner)
        assert uuid.UUID(metadata["idempotency_key"]).version == 4


async def test_every_lease_is_one_the_service_could_have_granted(loaded: tuple[str, LoadReport]) -> None:
    url, _ = loaded
    conn = await _connect(url)
    try:
        events = await _events(conn)
    finally:
        await conn.close()
    by_stream: dict[str, list[asyncpg.Record]] = defaultdict(list)
    for event in events:
        by_stream[event["stream_id"]].append(event)
    kinds: set[str] = set()
    for stream, stream_events in by_stream.items():
        holder: tuple[str, int] | None = None
        deadline = datetime.min.replace(tzinfo=UTC)
        last_token = 0
        for event in stream_events:
            data, metadata = json.loads(event["data"]), json.loads(event["metadata"])
            _check_payload(event, data, metadata)
            kind, at = event["event_type"], event["recorded_at"]
            kinds.add(kind)
            lease = (data["owner"], data["fencing_token"])
            if kind == LOCK_ACQUIRED:
                assert holder is None, f"{stream} v{event['stream_version']}: acquired while held"
                assert data["fencing_token"] == event["stream_version"] > last_token
                holder, last_token = lease, data["fencing_token"]
            else:
                assert lease == holder, f"{stream} v{event['stream_version']}: not the holder's lease"
            if kind in GRANTING_EVENTS:
                assert kind == LOCK_ACQUIRED or at < deadline, f"{stream}: renewed after its deadline"
                deadline = datetime.fromisoformat(data["expires_at"])
                assert deadline == at + timedelta(milliseconds=data["ttl_ms"])
                continue
            assert datetime.fromisoformat(data["expires_at"]) == deadline
            if kind == LOCK_EXPIRED:
                assert at > deadline, f"{stream}: expired before its deadline"
            else:
                assert at < deadline, f"{stream}: released after its deadline"
            holder = None
        assert holder is None, f"{stream}: a lease left open at the end of the history"
    assert kinds == {LOCK_ACQUIRED, LOCK_RENEWED, LOCK_RELEASED, LOCK_EXPIRED, LOCK_FORCE_RELEASED}


async def test_lock_state_is_the_fold_of_the_log_and_a_rebuild(loaded: tuple[str, LoadReport]) -> None:
    url, _ = loaded
    conn = await _connect(url)
    try:
        events = await _events(conn)
        rows = {row["resource"]: dict(row) for row in await conn.fetch("SELECT * FROM lock_state")}
        await rebuild_lock_state(conn)
        rebuilt = {row["resource"]: dict(row) for row in await conn.fetch("SELECT * FROM lock_state")}
    finally:
        await conn.close()
    by_stream: dict[str, list[asyncpg.Record]] = defaultdict(list)
    for event in events:
        by_stream[event["stream_id"]].append(event)
    assert set(rows) == set(by_stream)
    for stream, stream_events in by_stream.items():
        folded = fold(
            initial_state(stream),
            [event_from_payload(stream, e["event_type"], json.loads(e["data"])) for e in stream_events],
        )
        row = rows[stream]
        assert lock_state_from_row(stream, row) == folded
        acquired = [e["recorded_at"] for e in stream_events if e["event_type"] == LOCK_ACQUIRED]
        assert (row["acquired_at"], row["updated_at"]) == (acquired[-1], stream_events[-1]["recorded_at"])
    assert rebuilt == rows


async def test_the_history_lies_in_monthly_partitions(loaded: tuple[str, LoadReport]) -> None:
    """As the service's partitions would hold it (migration 0010), not in the default partition; the
    stream heads the chain trigger keeps are the log's."""
    url, report = loaded
    conn = await _connect(url)
    try:
        by_partition = await conn.fetch(
            "SELECT tableoid::regclass::text AS name, count(*) AS n FROM events GROUP BY 1 ORDER BY 1"
        )
        heads = await conn.fetchval(
            "SELECT count(*) FROM stream_heads h JOIN events e"
            " ON (e.stream_id, e.stream_version, e.hash) = (h.stream_id, h.version, h.hash)"
        )
        # An index made on the parent only ("ON ONLY") stays invalid and covers no partition.
        invalid = await conn.fetch(
            "SELECT indexrelid::regclass::text AS name FROM pg_index"
            " WHERE indrelid = 'events'::regclass AND NOT indisvalid"
        )
    finally:
        await conn.close()
    names = [row["name"] for row in by_partition]
    assert "events_default" not in names
    assert len(names) >= SHAPE.span_days // 31
    assert all(name.startswith("events_p") and name.endswith("01") for name in names[1:])
    assert sum(row["n"] for row in by_partition) == report.events
    assert heads == report.streams
    assert [row["name"] for row in invalid] == []


async def test_holding_periods_are_what_their_projector_makes_of_the_log(
    loaded: tuple[str, LoadReport],
) -> None:
    """The loader builds holding_periods in one statement; the projector, page by page from the start of
    the log into a table of its own, makes the same rows, and its checkpoint takes over from the loader's."""
    url, _ = loaded
    conn = await _connect(url)
    try:
        loaded_rows = [dict(r) for r in await conn.fetch("SELECT * FROM holding_periods ORDER BY 1, 2")]
        checkpoint = await checkpoints.load(conn, HOLDING_PERIODS.name)
        assert checkpoint is not None
        assert checkpoint.lo == checkpoint.hi
        assert checkpoint.covered_until is not None
        assert checkpoint.covered_until > max(r["granted_at"] for r in loaded_rows)
        await conn.execute("CREATE TEMP TABLE replayed (LIKE holding_periods INCLUDING ALL)")
        await checkpoints.store(conn, initial_checkpoint("replayed"))
        try:
            await Projector(HOLDING_PERIODS, table="replayed", page=500).catch_up(conn)
        finally:
            await conn.execute("DELETE FROM projector_checkpoints WHERE name = 'replayed'")
        replayed = [dict(r) for r in await conn.fetch("SELECT * FROM replayed ORDER BY 1, 2")]
    finally:
        await conn.close()
    grants = sum(1 for r in loaded_rows if r["ended_by"] != LOCK_RENEWED)  # not vacuous: many leases
    assert grants > 100
    assert replayed == loaded_rows


async def test_the_service_carries_on_from_the_loaded_log(loaded: tuple[str, LoadReport]) -> None:
    url, report = loaded
    settings = Settings(database_url=url, reaper_enabled=False)
    pool = await create_pool(settings)
    try:
        async with pool.acquire() as conn:
            head = await conn.fetchrow(
                "SELECT resource, version FROM lock_state ORDER BY version DESC LIMIT 1"
            )
        assert head is not None
        service = lock_service_on_pool(pool, settings.ttl_bounds)
        owner = SHAPE.agent(0)
        result = await service.execute(
            Acquire(head["resource"], owner, 30_000), CommandContext(principal=owner)
        )
        assert isinstance(result.outcome, Granted), result
        assert result.outcome.fencing_token == head["version"] + 1
    finally:
        await pool.close()
    conn_ = await _connect(url)
    try:
        verified = await verify_chains(conn_)  # the trigger chained the new event onto the loaded ones
        with pytest.raises(asyncpg.PostgresError, match="append-only"):  # even for a superuser
            await conn_.execute("UPDATE events SET event_type = event_type WHERE position = 1")
    finally:
        await conn_.close()
    assert verified.ok, verified.broken
    assert verified.events == report.events + 1


@pytest.mark.parametrize("micros", [0, 250_000, 123_456, 100, 999_990])
async def test_deadlines_are_written_as_postgresql_writes_them(database_url: str, micros: int) -> None:
    at = datetime(2026, 5, 5, 9, 30, 0, micros, tzinfo=UTC)
    conn = await _connect(database_url)
    try:
        written = await conn.fetchval(
            "SELECT jsonb_build_object('expires_at', $1::timestamptz) ->> 'expires_at'", at
        )
    finally:
        await conn.close()
    assert pg_json_instant(at) == written
