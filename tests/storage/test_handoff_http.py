"""Hand-off of a live lease over real HTTP, through a real server on PostgreSQL
(docs/decisions/0047-lease-hand-off.md): one command passes the lease, the receiver holds it at once with
a higher token, the giver's token is refused from then on, and the log, the lock's state, an agent's
history and replay all show both sides. The receiver accepts (learning its token, once), declines, or
lets the hand-off lapse to the reaper."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from domain.access import Role
from tests.assertions import assert_problem
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


async def acquire(http: httpx.AsyncClient, resource: str, owner: str, **headers: str) -> int:
    taken = await http.post(
        f"/v1/locks/{resource}/acquire", json={"owner": owner, "ttl_ms": 20_000}, headers=headers
    )
    assert taken.status_code == 201, taken.text
    token: int = taken.json()["fencing_token"]
    return token


async def log(admin_pool: asyncpg.Pool, resource: str) -> list[asyncpg.Record]:
    return await admin_pool.fetch(
        "SELECT stream_version, event_type, data, metadata, recorded_at FROM events"
        " WHERE stream_id = $1 ORDER BY stream_version",
        resource,
    )


async def test_hand_off_passes_the_lease_with_a_higher_token_and_no_gap(
    http: httpx.AsyncClient, resource: str, unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    giver, receiver = f"{unique_prefix}agv-1", f"{unique_prefix}agv-2"
    token = await acquire(http, resource, giver)

    handed = await http.post(
        f"/v1/locks/{resource}/handoff",
        json={"owner": giver, "fencing_token": token, "to": receiver, "accept_within_ms": 10_000},
    )
    assert handed.status_code == 200, handed.text
    answer = handed.json()
    assert answer["owner"] == receiver
    assert answer["fencing_token"] > token
    assert (answer["from_owner"], answer["from_token"], answer["accept_within_ms"]) == (giver, token, 10_000)

    # The receiver holds it at once; the giver's token is refused from now on.
    state = (await http.get(f"/v1/locks/{resource}")).json()
    assert (state["status"], state["owner"], state["fencing_token"]) == (
        "held",
        receiver,
        answer["fencing_token"],
    )
    assert state["handed_off_by"] == giver
    for action, body in [
        ("renew", {"owner": giver, "fencing_token": token}),
        ("release", {"owner": giver, "fencing_token": token}),
        ("handoff", {"owner": giver, "fencing_token": token, "to": f"{unique_prefix}agv-3"}),
    ]:
        assert_problem(await http.post(f"/v1/locks/{resource}/{action}", json=body), 409, "not_holder")
    assert_problem(await http.post(f"/v1/locks/{resource}/acquire", json={"owner": giver}), 409, "lock_held")

    # The receiver accepts: its own TTL, and its token, once.
    accepted = await http.post(f"/v1/locks/{resource}/accept", json={"owner": receiver, "ttl_ms": 15_000})
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["fencing_token"] == answer["fencing_token"]
    assert accepted.json()["ttl_ms"] == 15_000
    again = await http.post(f"/v1/locks/{resource}/accept", json={"owner": receiver})
    assert_problem(again, 409, "not_holder")
    assert (await http.get(f"/v1/locks/{resource}")).json()["handed_off_by"] is None
    renewed = await http.post(
        f"/v1/locks/{resource}/renew", json={"owner": receiver, "fencing_token": answer["fencing_token"]}
    )
    assert renewed.status_code == 200, renewed.text

    # The log shows both sides: the hand-off names the giver, its acceptance is the receiver's renewal.
    events = await log(admin_pool, resource)
    assert [e["event_type"] for e in events] == [
        "LOCK_ACQUIRED",
        "LOCK_HANDED_OFF",
        "LOCK_RENEWED",
        "LOCK_RENEWED",
    ]
    hand_off = events[1]
    assert hand_off["stream_version"] == answer["fencing_token"]
    assert json.loads(hand_off["data"])["from_owner"] == giver
    assert json.loads(hand_off["data"])["from_token"] == token
    assert json.loads(events[2]["metadata"])["command"] == "accept"

    # Both agents' histories show it; the giver's ends with the hand-off it gave.
    for agent in (giver, receiver):
        history = (await http.get(f"/v1/agents/{agent}/history")).json()["events"]
        assert "LOCK_HANDED_OFF" in [e["type"] for e in history], agent
    giver_history = (await http.get(f"/v1/agents/{giver}/history")).json()["events"]
    assert [e["type"] for e in giver_history] == ["LOCK_ACQUIRED", "LOCK_HANDED_OFF"]

    # Replay: the giver up to the instant before, the receiver from the hand-off's very instant on.
    at: datetime = hand_off["recorded_at"]
    for instant, holder, held_token, since in [
        (at - timedelta(microseconds=1), giver, token, events[0]["recorded_at"]),
        (at, receiver, answer["fencing_token"], at),
    ]:
        replayed = await http.get("/v1/replay/state", params={"at": instant.isoformat(), "prefix": resource})
        assert replayed.status_code == 200, replayed.text
        [lease] = replayed.json()["locks"]
        assert (lease["owner"], lease["fencing_token"]) == (holder, held_token)
        assert datetime.fromisoformat(lease["acquired_at"]) == since


async def test_a_retried_hand_off_is_replayed_not_repeated(
    http: httpx.AsyncClient, resource: str, unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    giver = f"{unique_prefix}agv-1"
    token = await acquire(http, resource, giver)
    key = {"Idempotency-Key": f"handoff-{uuid.uuid4().hex}"}
    body = {"owner": giver, "fencing_token": token, "to": f"{unique_prefix}agv-2"}
    first = await http.post(f"/v1/locks/{resource}/handoff", json=body, headers=key)
    second = await http.post(f"/v1/locks/{resource}/handoff", json=body, headers=key)
    assert first.status_code == second.status_code == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    other = await http.post(
        f"/v1/locks/{resource}/handoff", json={**body, "accept_within_ms": 5_000}, headers=key
    )
    assert_problem(other, 422, "idempotency_key_reused")
    assert [e["event_type"] for e in await log(admin_pool, resource)] == ["LOCK_ACQUIRED", "LOCK_HANDED_OFF"]


async def test_the_receiver_may_decline(
    http: httpx.AsyncClient, resource: str, unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    giver, receiver = f"{unique_prefix}agv-1", f"{unique_prefix}agv-2"
    token = await acquire(http, resource, giver)
    body = {"owner": giver, "fencing_token": token, "to": receiver}
    assert (await http.post(f"/v1/locks/{resource}/handoff", json=body)).status_code == 200
    stranger = await http.post(f"/v1/locks/{resource}/decline", json={"owner": f"{unique_prefix}agv-3"})
    assert_problem(stranger, 409, "not_holder")
    declined = await http.post(f"/v1/locks/{resource}/decline", json={"owner": receiver})
    assert declined.status_code == 200, declined.text
    assert declined.json()["released"] is True
    assert (await http.get(f"/v1/locks/{resource}")).json()["status"] == "free"
    assert [e["event_type"] for e in await log(admin_pool, resource)] == [
        "LOCK_ACQUIRED",
        "LOCK_HANDED_OFF",
        "LOCK_RELEASED",
    ]
    assert (await http.post(f"/v1/locks/{resource}/acquire", json={"owner": giver})).status_code == 201


async def test_a_hand_off_not_accepted_in_time_lapses_and_is_reaped(
    http: httpx.AsyncClient, resource: str, unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    giver, receiver = f"{unique_prefix}agv-1", f"{unique_prefix}agv-2"
    token = await acquire(http, resource, giver)
    body = {"owner": giver, "fencing_token": token, "to": receiver, "accept_within_ms": 1_000}
    handed = await http.post(f"/v1/locks/{resource}/handoff", json=body)
    assert handed.status_code == 200, handed.text
    for _ in range(300):  # the reaper (every 100 ms) expires it once its deadline has passed
        types = [e["event_type"] for e in await log(admin_pool, resource)]
        if types[-1] == "LOCK_EXPIRED":
            break
        await asyncio.sleep(0.05)
    assert types == ["LOCK_ACQUIRED", "LOCK_HANDED_OFF", "LOCK_EXPIRED"]
    late = await http.post(f"/v1/locks/{resource}/accept", json={"owner": receiver})
    assert_problem(late, 409, "not_holder")
    assert (await http.post(f"/v1/locks/{resource}/acquire", json={"owner": giver})).status_code == 201


@pytest.mark.parametrize(
    "body",
    [
        {"fencing_token": 1, "to": "agv 2"},
        {"fencing_token": 1, "to": ""},
        {"fencing_token": 1},
        {"fencing_token": 1, "to": "agv-2", "accept_within_ms": 10},
        {"fencing_token": 1, "to": "agv-2", "accept_within_ms": "1000"},
        {"fencing_token": 1, "to": "agv-1"},  # to itself
    ],
)
async def test_invalid_hand_offs_are_422(
    http: httpx.AsyncClient, resource: str, body: dict[str, Any]
) -> None:
    await acquire(http, resource, "agv-1")
    answer = await http.post(f"/v1/locks/{resource}/handoff", json={"owner": "agv-1", **body})
    assert_problem(answer, 422, "validation_error")


async def test_with_authentication_the_giver_is_the_principal_and_the_receiver_is_named(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str, resource: str
) -> None:
    names = {who: f"{unique_prefix}{who}" for who in ("giver", "receiver", "stranger")}
    tokens = {who: await issue_token(name, Role.AGENT) for who, name in names.items()}
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30.0) as api:

        def auth(who: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {tokens[who]}"}

        taken = await api.post(f"/v1/locks/{resource}/acquire", json={}, headers=auth("giver"))
        token = taken.json()["fencing_token"]
        body = {"fencing_token": token, "to": names["receiver"]}
        # Nobody hands off a lease as someone else, nor another's lease.
        as_other = await api.post(
            f"/v1/locks/{resource}/handoff", json={**body, "owner": names["stranger"]}, headers=auth("giver")
        )
        assert_problem(as_other, 403, "forbidden")
        assert_problem(
            await api.post(f"/v1/locks/{resource}/handoff", json=body, headers=auth("stranger")),
            403,
            "forbidden",
        )

        handed = await api.post(f"/v1/locks/{resource}/handoff", json=body, headers=auth("giver"))
        assert handed.status_code == 200, handed.text
        assert handed.json()["from_owner"] == names["giver"]
        stranger = await api.post(f"/v1/locks/{resource}/accept", json={}, headers=auth("stranger"))
        assert_problem(stranger, 409, "not_holder")
        accepted = await api.post(f"/v1/locks/{resource}/accept", json={}, headers=auth("receiver"))
        assert accepted.status_code == 200, accepted.text
        assert accepted.json()["owner"] == names["receiver"]
        # The giver's old lease is someone else's now: 403, as for any lease of another principal.
        stale = await api.post(
            f"/v1/locks/{resource}/renew", json={"fencing_token": token}, headers=auth("giver")
        )
        assert_problem(stale, 403, "forbidden")


async def test_a_hand_off_passes_a_queued_lock_on_and_the_queue_is_served_after(
    http: httpx.AsyncClient, resource: str, unique_prefix: str
) -> None:
    """A hand-off passes a held lease on: it does not wait for the acquires queued for the lock, which
    are served when the receiver lets it go."""
    giver, receiver, waiter = (f"{unique_prefix}{name}" for name in ("agv-1", "forklift-1", "agv-2"))
    token = await acquire(http, resource, giver)
    waiting = asyncio.create_task(
        http.post(
            f"/v1/locks/{resource}/acquire", json={"owner": waiter, "ttl_ms": 20_000, "wait_ms": 20_000}
        )
    )
    for _ in range(200):  # until the waiter's ticket is in the queue
        if (await http.get(f"/v1/locks/{resource}")).json()["queue"]:
            break
        await asyncio.sleep(0.05)
    handed = await http.post(
        f"/v1/locks/{resource}/handoff",
        json={"owner": giver, "fencing_token": token, "to": receiver, "accept_within_ms": 10_000},
    )
    assert handed.status_code == 200, handed.text
    state = (await http.get(f"/v1/locks/{resource}")).json()
    assert state["owner"] == receiver
    assert [queued["owner"] for queued in state["queue"]] == [waiter]
    assert not waiting.done()

    declined = await http.post(f"/v1/locks/{resource}/decline", json={"owner": receiver})
    assert declined.status_code == 200, declined.text
    granted = await asyncio.wait_for(waiting, timeout=15)
    assert granted.status_code == 201, granted.text
    assert granted.json()["fencing_token"] > handed.json()["fencing_token"]
    assert (await http.get(f"/v1/locks/{resource}")).json()["queue"] == []
