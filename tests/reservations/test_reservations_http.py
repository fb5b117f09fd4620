"""Reservations end to end: HTTP through a real server (``tests/servers.py``) on a real PostgreSQL.

What a client sees: the set granted with a token per resource and one deadline, 409 naming every held
resource and its holder, nothing taken when any is held, waiting holding nothing, renewal and release of
the set or of one lease, Idempotency-Keys, the owner rule with tokens; and what the log holds: the
events of one reservation in one transaction, each naming the reservation.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from domain.access import Role
from tests.assertions import assert_problem
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


async def _reserve(http: httpx.AsyncClient, owner: str, resources: list[str], **extra: Any) -> httpx.Response:
    return await http.post("/v1/reservations", json={"owner": owner, "resources": resources, **extra})


def _leases(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"resource": lease["resource"], "fencing_token": lease["fencing_token"]} for lease in body["leases"]
    ]


async def test_a_reservation_grants_every_resource_with_its_own_token(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    taken = await http.post(f"/v1/locks/{a2}/acquire", json={"owner": "agv-9", "ttl_ms": 1000})
    released = await http.post(
        f"/v1/locks/{a2}/release", json={"owner": "agv-9", "fencing_token": taken.json()["fencing_token"]}
    )
    assert released.status_code == 200

    answer = await _reserve(http, "agv-1", [a2, a1], ttl_ms=20_000)

    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert body["owner"] == "agv-1"
    assert body["ttl_ms"] == 20_000
    assert [lease["resource"] for lease in body["leases"]] == [a2, a1]  # the order asked
    assert {lease["resource"]: lease["fencing_token"] for lease in body["leases"]} == {a2: 3, a1: 1}
    for resource in (a1, a2):
        state = (await http.get(f"/v1/locks/{resource}")).json()
        assert state["status"] == "held"
        assert state["owner"] == "agv-1"
        assert state["expires_at"] == body["expires_at"]  # one deadline for the set


async def test_a_held_resource_refuses_the_whole_set_and_names_every_holder(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    a1, a2, a3 = (f"{unique_prefix}{zone}" for zone in ("A1", "A2", "A3"))
    assert (await http.post(f"/v1/locks/{a1}/acquire", json={"owner": "agv-7"})).status_code == 201
    assert (await http.post(f"/v1/locks/{a3}/acquire", json={"owner": "agv-8"})).status_code == 201

    refused = await _reserve(http, "agv-1", [a1, a2, a3])

    problem = assert_problem(refused, 409, "lock_held")
    assert problem["resource"] == a1
    assert problem["holder"] == "agv-7"
    assert [(c["resource"], c["holder"]) for c in problem["conflicts"]] == [(a1, "agv-7"), (a3, "agv-8")]
    free = (await http.get(f"/v1/locks/{a2}")).status_code
    assert free == 404  # a2 was never touched: no partial set


async def test_renew_and_release_the_set_or_one_lease(http: httpx.AsyncClient, unique_prefix: str) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    body = (await _reserve(http, "agv-1", [a1, a2], ttl_ms=5_000, reservation_id="route-7")).json()
    assert body["reservation_id"] == "route-7"

    renewed = await http.post(
        "/v1/reservations/route-7/renew", json={"owner": "agv-1", "leases": _leases(body), "ttl_ms": 60_000}
    )
    assert renewed.status_code == 200, renewed.text
    assert renewed.json()["ttl_ms"] == 60_000
    assert renewed.json()["expires_at"] > body["expires_at"]
    for resource in (a1, a2):
        assert (await http.get(f"/v1/locks/{resource}")).json()["expires_at"] == renewed.json()["expires_at"]

    [first, second] = _leases(body)
    left = await http.post("/v1/reservations/route-7/release", json={"owner": "agv-1", "leases": [first]})
    assert left.status_code == 200, left.text
    assert left.json()["released"] is True
    assert (await http.get(f"/v1/locks/{a1}")).json()["status"] == "free"
    assert (await http.get(f"/v1/locks/{a2}")).json()["status"] == "held"

    # The whole set can no longer be renewed: a1 has ended; nothing is renewed.
    stale = await http.post(
        "/v1/reservations/route-7/renew", json={"owner": "agv-1", "leases": _leases(body)}
    )
    problem = assert_problem(stale, 409, "not_holder")
    assert problem["resource"] == a1
    # The rest is renewed and released as the vehicle goes on.
    rest = await http.post("/v1/reservations/route-7/renew", json={"owner": "agv-1", "leases": [second]})
    assert rest.status_code == 200
    done = await http.post("/v1/reservations/route-7/release", json={"owner": "agv-1", "leases": [second]})
    assert done.status_code == 200
    assert (await http.get(f"/v1/locks/{a2}")).json()["status"] == "free"


async def test_a_reservation_waits_holding_nothing_until_every_resource_is_free(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    held = (await http.post(f"/v1/locks/{a2}/acquire", json={"owner": "agv-7"})).json()
    waiting = asyncio.create_task(_reserve(http, "agv-1", [a1, a2], wait_ms=10_000))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    assert (await http.get(f"/v1/locks/{a1}")).status_code == 404  # the free one is not held meanwhile
    # Another agent may take the free one while the reservation waits: nothing blocks it.
    other = await http.post(f"/v1/locks/{a1}/acquire", json={"owner": "agv-8"})
    assert other.status_code == 201
    await http.post(f"/v1/locks/{a1}/release", json={"owner": "agv-8", "fencing_token": 1})
    await http.post(
        f"/v1/locks/{a2}/release", json={"owner": "agv-7", "fencing_token": held["fencing_token"]}
    )

    answer = await asyncio.wait_for(waiting, 20)

    assert answer.status_code == 201, answer.text
    assert {lease["resource"] for lease in answer.json()["leases"]} == {a1, a2}


async def test_a_wait_that_runs_out_is_lock_held(http: httpx.AsyncClient, unique_prefix: str) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    assert (await http.post(f"/v1/locks/{a2}/acquire", json={"owner": "agv-7"})).status_code == 201

    refused = await _reserve(http, "agv-1", [a1, a2], wait_ms=300)

    assert assert_problem(refused, 409, "lock_held")["holder"] == "agv-7"
    assert (await http.get(f"/v1/locks/{a1}")).status_code == 404


async def test_an_idempotency_key_replays_the_set(http: httpx.AsyncClient, unique_prefix: str) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    headers = {"Idempotency-Key": f"{unique_prefix}k1"}
    request = {"owner": "agv-1", "resources": [a1, a2]}
    first = await http.post("/v1/reservations", json=request, headers=headers)
    again = await http.post("/v1/reservations", json=request, headers=headers)
    other = await http.post("/v1/reservations", json={**request, "ttl_ms": 9_000}, headers=headers)

    assert first.status_code == again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert_problem(other, 422, "idempotency_key_reused")
    history = (await http.get(f"/v1/locks/{a1}/history")).json()["events"]
    assert [event["type"] for event in history] == ["LOCK_ACQUIRED"]  # one grant, not two


async def test_the_events_of_a_reservation_are_one_transaction_naming_it(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    zones = [f"{unique_prefix}A{number}" for number in range(1, 5)]
    body = (await _reserve(http, "agv-1", zones, reservation_id=f"{unique_prefix}r")).json()
    await http.post(
        f"/v1/reservations/{unique_prefix}r/release", json={"owner": "agv-1", "leases": _leases(body)}
    )

    rows = await admin_pool.fetch(
        "SELECT stream_id, event_type, tx_id::text AS tx, metadata ->> 'reservation_id' AS reservation,"
        " metadata ->> 'command' AS command, recorded_at FROM events WHERE stream_id = ANY($1::text[])"
        " ORDER BY position",
        zones,
    )
    grants = [row for row in rows if row["event_type"] == "LOCK_ACQUIRED"]
    releases = [row for row in rows if row["event_type"] == "LOCK_RELEASED"]
    assert len(grants) == len(releases) == 4
    for batch, command in ((grants, "reserve"), (releases, "reserve-release")):
        assert len({row["tx"] for row in batch}) == 1  # one transaction each
        assert len({row["recorded_at"] for row in batch}) == 1  # one clock reading
        assert {row["reservation"] for row in batch} == {f"{unique_prefix}r"}
        assert {row["command"] for row in batch} == {command}
    assert grants[0]["tx"] != releases[0]["tx"]


async def test_invalid_reservations_are_validation_errors(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    twice = await _reserve(http, "agv-1", [f"{unique_prefix}A1", f"{unique_prefix}A1"])
    assert_problem(twice, 422, "validation_error")
    none = await _reserve(http, "agv-1", [])
    assert_problem(none, 422, "validation_error")
    too_many = await _reserve(http, "agv-1", [f"{unique_prefix}{n}" for n in range(65)])
    assert_problem(too_many, 422, "validation_error")


async def test_with_tokens_the_owner_is_the_principal(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    mine = await issue_token(f"{unique_prefix}agv-1", Role.AGENT)
    theirs = await issue_token(f"{unique_prefix}agv-2", Role.AGENT)
    viewer = await issue_token(f"{unique_prefix}wall", Role.DASHBOARD)
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30) as client:
        taken = await client.post(
            "/v1/reservations", json={"resources": [a1, a2]}, headers={"Authorization": f"Bearer {mine}"}
        )
        assert taken.status_code == 201, taken.text
        assert taken.json()["owner"] == f"{unique_prefix}agv-1"
        body = {"leases": _leases(taken.json())}
        rid = taken.json()["reservation_id"]
        stolen = await client.post(
            f"/v1/reservations/{rid}/release", json=body, headers={"Authorization": f"Bearer {theirs}"}
        )
        assert_problem(stolen, 403, "forbidden")
        refused = await client.post(
            "/v1/reservations", json={"resources": [a1]}, headers={"Authorization": f"Bearer {viewer}"}
        )
        assert_problem(refused, 403, "forbidden")
        done = await client.post(
            f"/v1/reservations/{rid}/release", json=body, headers={"Authorization": f"Bearer {mine}"}
        )
        assert done.status_code == 200


async def test_the_lock_list_and_a_lock_name_the_reservation_and_count_the_queue(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    """``GET /v1/locks`` and ``GET /v1/locks/{r}`` name the reservation of each reserved lease and count
    the acquires queued behind it; the lease the waiter then gets names none."""
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    body = (await _reserve(http, "agv-1", [a1, a2], ttl_ms=30_000, reservation_id="route-7")).json()
    waiting = asyncio.create_task(
        http.post(f"/v1/locks/{a2}/acquire", json={"owner": "agv-9", "ttl_ms": 30_000, "wait_ms": 20_000})
    )
    for _ in range(100):
        state = (await http.get(f"/v1/locks/{a2}")).json()
        if state["queue"]:
            break
        await asyncio.sleep(0.05)
    assert (state["reservation_id"], state["queued"]) == ("route-7", 1)
    assert [queued["owner"] for queued in state["queue"]] == ["agv-9"]
    listed = (await http.get("/v1/locks", params={"prefix": unique_prefix})).json()["items"]
    assert [(lock["resource"], lock["reservation_id"], lock["queued"]) for lock in listed] == [
        (a1, "route-7", 0), (a2, "route-7", 1),
    ]  # fmt: skip

    released = await http.post(
        "/v1/reservations/route-7/release", json={"owner": "agv-1", "leases": _leases(body)}
    )
    assert released.status_code == 200, released.text
    assert (await waiting).status_code == 201
    listed = (await http.get("/v1/locks", params={"prefix": unique_prefix})).json()["items"]
    assert [(lock["resource"], lock["owner"], lock["reservation_id"], lock["queued"]) for lock in listed] == [
        (a2, "agv-9", None, 0)
    ]


async def test_the_reaper_expires_the_set_and_replay_sees_it_held_before(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    """Reserved leases are ordinary leases: the reaper expires them together at their one deadline, and
    the fleet at an instant before it has each of them."""
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    body = (await _reserve(http, "agv-1", [a1, a2], ttl_ms=1_000)).json()
    at = body["expires_at"].replace("Z", "+00:00")
    for _ in range(100):  # the shared server's reaper runs every 100 ms
        states = [(await http.get(f"/v1/locks/{resource}")).json() for resource in (a1, a2)]
        if all(state["ended_by"] == "LOCK_EXPIRED" for state in states):
            break
        await asyncio.sleep(0.1)
    assert [state["ended_by"] for state in states] == ["LOCK_EXPIRED", "LOCK_EXPIRED"]
    renewed = await http.post(
        f"/v1/reservations/{body['reservation_id']}/renew", json={"owner": "agv-1", "leases": _leases(body)}
    )
    assert_problem(renewed, 410, "lease_expired")

    before = datetime.fromisoformat(at) - timedelta(milliseconds=500)
    replayed = await http.get("/v1/replay/state", params={"at": before.isoformat(), "prefix": unique_prefix})
    assert replayed.status_code == 200, replayed.text
    held = {lease["resource"]: lease["fencing_token"] for lease in replayed.json()["locks"]}
    assert held == {a1: 1, a2: 1}
