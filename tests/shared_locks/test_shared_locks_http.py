"""Shared locks and semaphores end to end: HTTP through a real server (``tests/servers.py``) on a real
PostgreSQL.

What a client sees: readers together, a writer alone, 409 naming every conflicting grant, a semaphore's
limit and its agreement, a writer that waits served before readers that came after it, waiting readers
granted together, renew and release by token, Idempotency-Keys, the owner rule with tokens, the reaper's
expiry, and that a shared lock is not the mutex of the same name.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx
import pytest

from domain.access import Role
from tests.assertions import assert_problem
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


async def _acquire(http: httpx.AsyncClient, resource: str, owner: str, **body: Any) -> httpx.Response:
    return await http.post(f"/v1/shared-locks/{resource}/acquire", json={"owner": owner, **body})


async def _release(http: httpx.AsyncClient, resource: str, owner: str, token: int) -> httpx.Response:
    return await http.post(
        f"/v1/shared-locks/{resource}/release", json={"owner": owner, "fencing_token": token}
    )


async def _queued(http: httpx.AsyncClient, resource: str, count: int) -> list[dict[str, Any]]:
    """The queue once ``count`` acquires wait in it (a waiter's ticket is taken after its first refusal)."""
    while True:
        queue: list[dict[str, Any]] = (await http.get(f"/v1/shared-locks/{resource}")).json()["queue"]
        if len(queue) >= count:
            return queue
        await asyncio.sleep(0.01)


async def _holders(http: httpx.AsyncClient, resource: str) -> list[str]:
    return [h["owner"] for h in (await http.get(f"/v1/shared-locks/{resource}")).json()["holders"]]


async def test_readers_share_and_a_writer_holds_alone(http: httpx.AsyncClient, resource: str) -> None:
    r1 = await _acquire(http, resource, "agv-1", mode="shared", ttl_ms=20_000)
    r2 = await _acquire(http, resource, "agv-2", mode="shared", ttl_ms=20_000)
    assert r1.status_code == 201, r1.text
    assert r2.status_code == 201, r2.text
    assert r1.json()["mode"] == "shared"
    assert r1.json()["limit"] is None
    assert (r1.json()["fencing_token"], r2.json()["fencing_token"]) == (1, 2)

    refused = assert_problem(await _acquire(http, resource, "forklift-1", ttl_ms=20_000), 409, "lock_held")
    assert sorted((c["owner"], c["mode"], c["fencing_token"]) for c in refused["conflicts"]) == [
        ("agv-1", "shared", 1),
        ("agv-2", "shared", 2),
    ]
    assert all("expires_at" in c for c in refused["conflicts"])

    state = (await http.get(f"/v1/shared-locks/{resource}")).json()
    assert [(h["owner"], h["mode"]) for h in state["holders"]] == [("agv-1", "shared"), ("agv-2", "shared")]
    assert state["queue"] == []
    # The mutex of the same name is another lock: free.
    mutex = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "agv-3", "ttl_ms": 1000})
    assert mutex.status_code == 201, mutex.text

    renewed = await http.post(
        f"/v1/shared-locks/{resource}/renew", json={"owner": "agv-1", "fencing_token": 1, "ttl_ms": 30_000}
    )
    assert renewed.status_code == 200, renewed.text
    assert renewed.json()["ttl_ms"] == 30_000
    assert renewed.json()["expires_at"] > r1.json()["expires_at"]
    assert (await _release(http, resource, "agv-1", 1)).status_code == 200
    assert (await _release(http, resource, "agv-2", 2)).status_code == 200
    assert_problem(await _release(http, resource, "agv-2", 2), 409, "not_holder")

    writer = await _acquire(http, resource, "forklift-1", ttl_ms=20_000)
    assert writer.status_code == 201, writer.text
    assert writer.json()["mode"] == "exclusive"  # the default
    assert writer.json()["fencing_token"] == 6  # the stream version of its acquire
    reader = await _acquire(http, resource, "agv-1", mode="shared")
    assert assert_problem(reader, 409, "lock_held")["conflicts"][0]["owner"] == "forklift-1"
    stolen = await _release(http, resource, "agv-1", writer.json()["fencing_token"])
    assert_problem(stolen, 409, "not_holder")  # another's grant, without authentication
    metrics = (await http.get("/metrics")).text
    assert (
        'lockledger_shared_lock_commands_total{command="shared-acquire",mode="shared",outcome="lock_held"}'
        in (metrics)
    )


async def test_a_semaphore_grants_up_to_its_limit_and_every_holder_agrees_on_it(
    http: httpx.AsyncClient, resource: str
) -> None:
    tokens = []
    for owner in ("agv-1", "agv-2"):
        granted = await _acquire(http, resource, owner, mode="shared", limit=2, ttl_ms=20_000)
        assert granted.status_code == 201, granted.text
        assert granted.json()["limit"] == 2
        tokens.append(granted.json()["fencing_token"])
    full = assert_problem(await _acquire(http, resource, "agv-3", mode="shared", limit=2), 409, "lock_held")
    assert len(full["conflicts"]) == 2
    other = assert_problem(
        await _acquire(http, resource, "agv-3", mode="shared", limit=3), 409, "limit_mismatch"
    )
    assert other["limit"] == 2
    assert (await http.get(f"/v1/shared-locks/{resource}")).json()["limit"] == 2
    for owner, token in zip(("agv-1", "agv-2"), tokens, strict=True):
        assert (await _release(http, resource, owner, token)).status_code == 200
    # Once every holder is gone, the next acquire sets the limit.
    again = await _acquire(http, resource, "agv-3", mode="shared", limit=3, ttl_ms=1_000)
    assert again.status_code == 201, again.text


async def test_the_list_pages_through_live_grants_by_resource_then_token(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    """Readers, a writer and a semaphore's permits, listed by resource then token, filtered by prefix or
    holder, a page at a time; a released grant is not listed."""
    zone, bay, writer_zone = (f"{unique_prefix}{name}" for name in ("zone:A", "bay:1", "zone:B"))
    taken = [
        await _acquire(http, zone, "inspector-1", mode="shared", ttl_ms=20_000),
        await _acquire(http, zone, "inspector-2", mode="shared", ttl_ms=20_000),
        await _acquire(http, bay, "agv-1", mode="shared", limit=4, ttl_ms=20_000),
        await _acquire(http, writer_zone, "relayout", mode="exclusive", ttl_ms=20_000),
    ]
    assert all(t.status_code == 201 for t in taken), [t.text for t in taken]
    gone = await _acquire(http, bay, "agv-2", mode="shared", limit=4, ttl_ms=20_000)
    assert (await _release(http, bay, "agv-2", gone.json()["fencing_token"])).status_code == 200

    every = (await http.get("/v1/shared-locks", params={"prefix": unique_prefix})).json()
    listed = [(g["resource"], g["owner"], g["mode"], g["limit"], g["fencing_token"]) for g in every["items"]]
    assert listed == [
        (bay, "agv-1", "shared", 4, 1),
        (zone, "inspector-1", "shared", None, 1),
        (zone, "inspector-2", "shared", None, 2),
        (writer_zone, "relayout", "exclusive", None, 1),
    ]
    assert every["next_cursor"] is None
    first = every["items"][0]
    assert first["expires_at"] > every["at"] >= first["granted_at"]

    pages, cursor = [], None
    while True:
        params: dict[str, str | int] = {"prefix": unique_prefix, "limit": 1}
        if cursor is not None:
            params["cursor"] = cursor
        page = (await http.get("/v1/shared-locks", params=params)).json()
        pages += [(g["resource"], g["fencing_token"]) for g in page["items"]]
        if (cursor := page["next_cursor"]) is None:
            break
    assert pages == [(r, t) for r, _, _, _, t in listed]

    mine = (await http.get("/v1/shared-locks", params={"holder": "inspector-2"})).json()["items"]
    assert [(g["resource"], g["owner"]) for g in mine if g["resource"].startswith(unique_prefix)] == [
        (zone, "inspector-2")
    ]
    assert_problem(await http.get("/v1/shared-locks", params={"cursor": "no-token"}), 422, "validation_error")


async def test_bad_requests_are_422(http: httpx.AsyncClient, resource: str) -> None:
    for body in ({"mode": "read"}, {"mode": "shared", "limit": 0}, {"mode": "shared", "limit": 10_001}):
        assert_problem(await _acquire(http, resource, "agv-1", **body), 422, "validation_error")
    assert_problem(await _acquire(http, resource, "agv-1", ttl_ms=5), 422, "validation_error")
    assert (await http.get(f"/v1/shared-locks/{resource}")).status_code == 404


async def test_a_waiting_writer_is_served_before_readers_that_came_after_it(
    http: httpx.AsyncClient, resource: str
) -> None:
    first = await _acquire(http, resource, "reader-1", mode="shared", ttl_ms=20_000)
    writer = asyncio.create_task(_acquire(http, resource, "writer", ttl_ms=20_000, wait_ms=20_000))
    assert [w["mode"] for w in await _queued(http, resource, 1)] == ["exclusive"]

    # A reader that does not wait is refused at once, though only readers hold: a writer waits.
    late = assert_problem(await _acquire(http, resource, "reader-2", mode="shared"), 409, "lock_held")
    assert late["holder"] == "writer"
    # Readers that wait queue behind the writer.
    readers = [
        asyncio.create_task(
            _acquire(http, resource, f"reader-{n}", mode="shared", ttl_ms=20_000, wait_ms=20_000)
        )
        for n in (3, 4)
    ]
    queue = await _queued(http, resource, 3)
    assert [w["mode"] for w in queue] == ["exclusive", "shared", "shared"]
    assert await _holders(http, resource) == ["reader-1"]  # the waiting readers did not join it

    await _release(http, resource, "reader-1", first.json()["fencing_token"])
    granted = await writer
    assert granted.status_code == 201, granted.text
    assert await _holders(http, resource) == ["writer"]  # alone, the readers still queued
    assert [w["mode"] for w in (await http.get(f"/v1/shared-locks/{resource}")).json()["queue"]] == [
        "shared",
        "shared",
    ]

    await _release(http, resource, "writer", granted.json()["fencing_token"])
    answers = await asyncio.gather(*readers)
    assert [a.status_code for a in answers] == [201, 201]
    # The waiting readers were granted together: both hold now.
    assert sorted(await _holders(http, resource)) == ["reader-3", "reader-4"]
    assert min(a.json()["fencing_token"] for a in answers) > granted.json()["fencing_token"]


async def test_a_waiter_that_gives_up_leaves_the_queue(http: httpx.AsyncClient, resource: str) -> None:
    writer = await _acquire(http, resource, "writer", ttl_ms=20_000)
    refused = await _acquire(http, resource, "reader", mode="shared", wait_ms=100)
    assert_problem(refused, 409, "lock_held")
    assert (await http.get(f"/v1/shared-locks/{resource}")).json()["queue"] == []
    await _release(http, resource, "writer", writer.json()["fencing_token"])


async def test_an_idempotency_key_replays_the_grant(http: httpx.AsyncClient, resource: str) -> None:
    headers = {"Idempotency-Key": f"{resource}-key"}
    body = {"owner": "agv-1", "mode": "shared", "limit": 4, "ttl_ms": 20_000}
    first = await http.post(f"/v1/shared-locks/{resource}/acquire", json=body, headers=headers)
    again = await http.post(f"/v1/shared-locks/{resource}/acquire", json=body, headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"
    other = await http.post(
        f"/v1/shared-locks/{resource}/acquire", json={**body, "limit": 5}, headers=headers
    )
    assert_problem(other, 422, "idempotency_key_reused")
    assert len((await http.get(f"/v1/shared-locks/{resource}")).json()["holders"]) == 1


async def test_a_lapsed_grant_is_expired_before_the_waiting_writer_is_granted(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, resource: str
) -> None:
    reader = await _acquire(http, resource, "reader", mode="shared", ttl_ms=1_000)
    assert reader.status_code == 201, reader.text
    writer = await _acquire(http, resource, "writer", ttl_ms=20_000, wait_ms=20_000)
    assert writer.status_code == 201, writer.text  # by the reaper's expiry, or in its own decision
    rows = await admin_pool.fetch(
        "SELECT event_type FROM events WHERE stream_id = $1 ORDER BY stream_version", f"shared/{resource}"
    )
    assert [row["event_type"] for row in rows] == ["SHARED_ACQUIRED", "SHARED_EXPIRED", "SHARED_ACQUIRED"]


async def test_with_tokens_the_owner_is_the_caller(
    auth_server: ServerProcess, issue_token: IssueToken, resource: str, unique_prefix: str
) -> None:
    mine = await issue_token(f"{unique_prefix}agv-1", Role.AGENT)
    theirs = await issue_token(f"{unique_prefix}agv-2", Role.AGENT)
    viewer = await issue_token(f"{unique_prefix}wall", Role.DASHBOARD)
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30) as client:
        taken = await client.post(
            f"/v1/shared-locks/{resource}/acquire",
            json={"mode": "shared"},
            headers={"Authorization": f"Bearer {mine}"},
        )
        assert taken.status_code == 201, taken.text
        assert taken.json()["owner"] == f"{unique_prefix}agv-1"
        token = {"fencing_token": taken.json()["fencing_token"]}
        stolen = await client.post(
            f"/v1/shared-locks/{resource}/release", json=token, headers={"Authorization": f"Bearer {theirs}"}
        )
        assert_problem(stolen, 403, "forbidden")
        refused = await client.post(
            f"/v1/shared-locks/{resource}/acquire", json={}, headers={"Authorization": f"Bearer {viewer}"}
        )
        assert_problem(refused, 403, "forbidden")
        seen = await client.get(f"/v1/shared-locks/{resource}", headers={"Authorization": f"Bearer {viewer}"})
        assert seen.status_code == 200
        listed = await client.get(
            "/v1/shared-locks", params={"prefix": resource}, headers={"Authorization": f"Bearer {viewer}"}
        )
        assert [g["owner"] for g in listed.json()["items"]] == [f"{unique_prefix}agv-1"]
        done = await client.post(
            f"/v1/shared-locks/{resource}/release", json=token, headers={"Authorization": f"Bearer {mine}"}
        )
        assert done.status_code == 200, done.text
