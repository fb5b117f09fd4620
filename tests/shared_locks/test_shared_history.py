"""A shared lock's history (``GET /v1/shared-locks/{resource}/history``) over HTTP against a real server,
and through the SDK: its grants, renewals, releases and expiries in order, paged and by time as the
mutex's history (``/v1/locks/{resource}/history``), never the mutex's events, and the investigator's alone.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
import httpx
import pytest

import lockledger
from domain.access import Role
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


async def _post(http: httpx.AsyncClient, resource: str, command: str, **body: Any) -> dict[str, Any]:
    answer = await http.post(f"/v1/shared-locks/{resource}/{command}", json=body)
    assert answer.status_code in (200, 201), answer.text
    return dict(answer.json())


async def _history(http: httpx.AsyncClient, resource: str, **params: Any) -> dict[str, Any]:
    answer = await http.get(f"/v1/shared-locks/{resource}/history", params=params)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


async def _a_shared_lock_lived(http: httpx.AsyncClient, resource: str) -> datetime:
    """Two readers (one renewed, then released), a reader that lapsed and was expired to let a writer in,
    the writer released; and the mutex of the same name taken. The instant after the first release."""
    first = await _post(http, resource, "acquire", owner="agv-1", mode="shared", ttl_ms=20_000)
    await _post(http, resource, "renew", owner="agv-1", fencing_token=first["fencing_token"], ttl_ms=30_000)
    await _post(http, resource, "release", owner="agv-1", fencing_token=first["fencing_token"])
    after_release = datetime.fromisoformat(
        (await http.get(f"/v1/shared-locks/{resource}/history")).json()["events"][-1]["recorded_at"]
    )
    await _post(http, resource, "acquire", owner="agv-2", mode="shared", ttl_ms=1_000)
    # The writer waits for the reader's deadline: its SHARED_EXPIRED comes before the writer's grant.
    writer = await _post(http, resource, "acquire", owner="forklift-1", ttl_ms=20_000, wait_ms=20_000)
    await _post(http, resource, "release", owner="forklift-1", fencing_token=writer["fencing_token"])
    mutex = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "agv-3", "ttl_ms": 1000})
    assert mutex.status_code == 201, mutex.text
    return after_release


EVERY = [
    ("SHARED_ACQUIRED", "agv-1", 1),
    ("SHARED_RENEWED", "agv-1", 1),
    ("SHARED_RELEASED", "agv-1", 1),
    ("SHARED_ACQUIRED", "agv-2", 4),
    ("SHARED_EXPIRED", "agv-2", 4),
    ("SHARED_ACQUIRED", "forklift-1", 6),
    ("SHARED_RELEASED", "forklift-1", 6),
]


async def test_a_shared_locks_events_in_order_paged_and_by_time(
    http: httpx.AsyncClient, resource: str
) -> None:
    after_release = await _a_shared_lock_lived(http, resource)
    history = await _history(http, resource)
    assert history["resource"] == resource
    events = history["events"]
    assert [(e["type"], e["data"]["owner"], e["data"]["fencing_token"]) for e in events] == EVERY
    assert [e["version"] for e in events] == list(range(1, 8))
    assert [
        (e["data"]["mode"], e["data"].get("limit")) for e in events if e["type"] == "SHARED_ACQUIRED"
    ] == [
        ("shared", None),
        ("shared", None),
        ("exclusive", None),
    ]
    assert history["next_after_version"] is None
    positions = [e["position"] for e in events]
    assert positions == sorted(positions)

    first = await _history(http, resource, limit=3)
    assert first["next_after_version"] == 3
    rest = await _history(http, resource, after_version=3, limit=10)
    assert first["events"] + rest["events"] == events

    earlier = await _history(http, resource, to=after_release.isoformat())
    assert [e["type"] for e in earlier["events"]] == ["SHARED_ACQUIRED", "SHARED_RENEWED"]
    later = await _history(http, resource, **{"from": after_release.isoformat()})
    assert [e["version"] for e in later["events"]] == [3, 4, 5, 6, 7]

    mutex = (await http.get(f"/v1/locks/{resource}/history")).json()["events"]
    assert [e["type"] for e in mutex] == ["LOCK_ACQUIRED"]


async def test_a_shared_lock_never_taken_has_an_empty_history_as_a_mutex_never_locked(
    http: httpx.AsyncClient, resource: str
) -> None:
    mutex = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "agv-1", "ttl_ms": 1000})
    assert mutex.status_code == 201, mutex.text
    assert (await _history(http, resource))["events"] == []
    never = (await http.get(f"/v1/locks/{resource}:never/history")).json()
    assert (
        never
        == await _history(http, f"{resource}:never")
        == {
            "resource": f"{resource}:never",
            "events": [],
            "next_after_version": None,
        }
    )


async def test_a_bad_resource_or_range_is_422(http: httpx.AsyncClient, resource: str) -> None:
    for path, params in (
        ("/v1/shared-locks/a b/history", {}),
        (f"/v1/shared-locks/{resource}/history", {"limit": 0}),
        (f"/v1/shared-locks/{resource}/history", {"after_version": 2**63}),
        (f"/v1/shared-locks/{resource}/history", {"from": "yesterday"}),
    ):
        answer = await http.get(path, params=params)
        assert answer.status_code == 422, (path, params, answer.text)


async def test_only_the_investigator_and_admin_read_it(
    auth_server: ServerProcess, issue_token: IssueToken, resource: str, unique_prefix: str
) -> None:
    path = f"/v1/shared-locks/{resource}/history"
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30) as client:
        assert (await client.get(path)).status_code == 401
        for role, status in (
            (Role.AGENT, 403),
            (Role.DASHBOARD, 403),
            (Role.INVESTIGATOR, 200),
            (Role.ADMIN, 200),
        ):
            token = await issue_token(f"{unique_prefix}{role.value}", role)
            answer = await client.get(path, headers={"Authorization": f"Bearer {token}"})
            assert answer.status_code == status, (role, answer.text)


async def test_the_sdk_reads_it_with_shared_true_in_both_twins(
    server: ServerProcess, http: httpx.AsyncClient, admin_pool: asyncpg.Pool, resource: str
) -> None:
    await _a_shared_lock_lived(http, resource)
    stream = f"shared/{resource}"
    async with lockledger.AsyncClient(server.base_url) as client:
        history = await client.history(resource, shared=True)
        page = await client.history(resource, 2, 3, shared=True)
        mutex = await client.history(resource)
    assert history.resource == resource
    assert [(e.type, e.data["owner"]) for e in history.events] == [(kind, who) for kind, who, _ in EVERY]
    assert {e.resource for e in history.events} == {stream}  # as an agent's history and the export name it
    assert [e.version for e in page.events] == [3, 4, 5]
    assert page.next_after_version == 5
    assert [(e.type, e.resource) for e in mutex.events] == [("LOCK_ACQUIRED", resource)]
    with lockledger.Client(server.base_url) as blocking:
        assert blocking.history(resource, shared=True).events == history.events
