"""The log's readers take shared-lock events in stride: with ``SHARED_*`` events in the log, every reader of
the whole log still answers (the chain verifies, the projectors catch up, the change feed, export, agent
history, replay at T and the audit digest serve them or pass them by), replay at T lists the grants
beside the mutex of the same name, and what serves the mutex's state still shows only mutex leases."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import httpx
import pytest

from domain.timestamps import format_timestamp
from eventstore.verify import verify_chains
from service.projectors import ProjectorRunner
from tests.servers import ServerProcess

pytestmark = pytest.mark.storage


async def test_shared_events_break_no_reader(
    server: ServerProcess,
    http: httpx.AsyncClient,
    admin_pool: asyncpg.Pool,
    service_pool: asyncpg.Pool,
    unique_prefix: str,
) -> None:
    owner = f"{unique_prefix}reader"
    resource = f"{unique_prefix}zone"
    granted = await http.post(
        f"/v1/shared-locks/{resource}/acquire", json={"owner": owner, "mode": "shared", "ttl_ms": 60_000}
    )
    assert granted.status_code == 201, granted.text
    renewed = await http.post(f"/v1/shared-locks/{resource}/renew", json={"owner": owner, "fencing_token": 1})
    assert renewed.status_code == 200, renewed.text
    mutex = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": owner, "ttl_ms": 60_000})
    assert mutex.status_code == 201, mutex.text

    async with admin_pool.acquire() as conn:
        report = await verify_chains(conn)
        first = await conn.fetchrow(
            "SELECT min(recorded_at), min(position) FROM events WHERE stream_id = $1", f"shared/{resource}"
        )
        now = await conn.fetchval("SELECT clock_timestamp()")
    assert first is not None
    began, first_position = first
    at = format_timestamp(now)
    assert report.broken is None

    await ProjectorRunner(service_pool, settle=timedelta(0)).run_once()  # holding_periods, agent_stats
    history = await http.get(f"/v1/agents/{owner}/history")
    assert history.status_code == 200, history.text
    # An agent's history is every event naming it: its shared grants too.
    assert [e["type"] for e in history.json()["events"]] == [
        "SHARED_ACQUIRED",
        "SHARED_RENEWED",
        "LOCK_ACQUIRED",
    ]
    events = await http.get("/v1/events", params={"owner": owner})
    assert events.status_code == 200, events.text
    state = await http.get("/v1/replay/state", params={"at": at, "prefix": unique_prefix})
    assert state.status_code == 200, state.text
    # Replay at T lists the mutex lease, then the shared lock's grant of the same name, with its mode.
    assert [
        (lease["resource"], lease["mode"], lease["fencing_token"]) for lease in state.json()["locks"]
    ] == [
        (resource, None, 1),
        (resource, "shared", 1),
    ]
    changes = await http.get(
        "/v1/replay/changes", params={"from": format_timestamp(began), "to": at, "prefix": unique_prefix}
    )
    assert changes.status_code == 200, changes.text
    # The changes name the shared lock's stream, and the prefix finds them by resource.
    assert [(change["resource"], change["type"]) for change in changes.json()["changes"]] == [
        (f"shared/{resource}", "SHARED_RENEWED"),
        (resource, "LOCK_ACQUIRED"),
    ]
    assert (await http.get("/v1/audit/digest")).status_code == 200
    assert (await http.get("/v1/stats")).status_code == 200
    listed = (await http.get("/v1/locks", params={"prefix": unique_prefix})).json()["items"]
    assert [(lock["resource"], lock["owner"]) for lock in listed] == [(resource, owner)]
    lock = await http.get(f"/v1/locks/{resource}/history")
    assert [e["type"] for e in lock.json()["events"]] == ["LOCK_ACQUIRED"]
    # The change feed sends them as any event (from the shared lock's first event on).
    params = {"after_position": str(first_position - 1), "prefix": "shared/"}
    async with asyncio.timeout(30), http.stream("GET", "/v1/events/stream", params=params) as feed:
        assert feed.status_code == 200
        async for line in feed.aiter_lines():
            if "SHARED_RENEWED" in line:
                break
