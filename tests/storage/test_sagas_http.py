"""Sagas end to end, over real HTTP against a real server and PostgreSQL.

The happy path; a failing step compensated in reverse; repeated transitions and Idempotency-Keys; 409
``saga_conflict`` for a transition out of order; roles (an agent drives its own sagas, dashboards read,
admins abort); ``stuck`` after the fifth failure of one compensation; the filters and pages of
``GET /v1/sagas``; a lock acquired within a saga shows it (``X-Saga-ID``, ``X-Saga-Step``); the saga's
events keep the hash chain, and rebuild reproduces saga_state and the locks' saga columns. The saga's
lease: heartbeats renew it, the reaper's pass lapses it (compensation, then ``stuck``), bounds and
default, and rebuild reproduces its columns.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from domain.access import Role
from domain.timestamps import TIMESTAMP_PATTERN
from eventstore.verify import event_hash, verify_chains
from projections.rebuild import rebuild_lock_state
from projections.saga_state import rebuild_saga_state
from service.composition import saga_service_on_pool
from service.database_guard import DatabaseGuard
from service.reaper_store import due_sagas
from service.saga_lapse import lapse_sagas
from tests.assertions import assert_problem
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


@pytest.fixture
async def api(auth_server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30.0) as client:
        yield client


class Caller:
    """One token's view of the API."""

    def __init__(self, api: httpx.AsyncClient, name: str, token: str) -> None:
        self.api, self.name, self.headers = api, name, {"Authorization": f"Bearer {token}"}

    async def post(self, path: str, body: Any = None, **headers: str) -> httpx.Response:
        return await self.api.post(path, json=body, headers={**self.headers, **headers})

    async def get(self, path: str, **params: Any) -> httpx.Response:
        return await self.api.get(path, params=params, headers=self.headers)


@pytest.fixture
async def callers(api: httpx.AsyncClient, issue_token: IssueToken, unique_prefix: str) -> dict[str, Caller]:
    made = {}
    for who, role in [
        ("agent", Role.AGENT),
        ("other", Role.AGENT),
        ("dashboard", Role.DASHBOARD),
        ("investigator", Role.INVESTIGATOR),
        ("admin", Role.ADMIN),
    ]:
        name = f"{unique_prefix}{who}"
        made[who] = Caller(api, name, await issue_token(name, role))
    return made


def definition(saga_id: str, *steps: str, name: str = "move pallet") -> dict[str, Any]:
    return {
        "saga_id": saga_id,
        "name": name,
        "steps": [{"name": s, "locks": [f"{saga_id}:{s}"]} for s in steps],
    }


async def create(caller: Caller, saga_id: str, *steps: str, name: str = "move pallet") -> dict[str, Any]:
    response = await caller.post("/v1/sagas", definition(saga_id, *steps, name=name))
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


async def ok_created(caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    response = await caller.post("/v1/sagas", body)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def step(caller: Caller, saga_id: str, name: str, action: str, body: Any = None) -> dict[str, Any]:
    return await ok(await caller.post(f"/v1/sagas/{saga_id}/steps/{name}/{action}", body))


async def timeline_types(caller: Caller, saga_id: str) -> list[str]:
    detail = await ok(await caller.get(f"/v1/sagas/{saga_id}"))
    return [entry["type"] for entry in detail["timeline"]]


async def test_happy_path(callers: dict[str, Caller], unique_prefix: str) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}happy"
    created = await create(agent, saga_id, "pick", "drop")
    assert created["status"] == "running"
    assert created["owner"] == agent.name
    assert created["policy"] == "compensate"
    assert created["version"] == 1
    assert created["reason"] is None
    assert [s["status"] for s in created["steps"]] == ["pending", "pending"]
    assert created["steps"][0]["locks"] == [f"{saga_id}:pick"]
    for instant in (created["started_at"], created["updated_at"]):
        assert re.match(TIMESTAMP_PATTERN, instant)

    # The same definition again: 200 and the saga as it is; another definition: 409 conflict.
    again = await agent.post("/v1/sagas", definition(saga_id, "pick", "drop"))
    assert again.status_code == 200
    assert again.json() == created
    assert_problem(await agent.post("/v1/sagas", definition(saga_id, "pick")), 409, "conflict")

    await step(agent, saga_id, "pick", "start")
    done = await step(agent, saga_id, "pick", "complete", {"result": {"bin": 7, "note": "a\u0000b"}})
    assert done["steps"][0] == {
        "name": "pick", "locks": [f"{saga_id}:pick"], "status": "completed",
        "result": {"bin": 7, "note": "a\u0000b"}, "error": None, "compensation_failures": 0,
        "route": False, "reservation_id": None,
    }  # fmt: skip
    await step(agent, saga_id, "drop", "start")
    await step(agent, saga_id, "drop", "complete")
    completed = await ok(await agent.post(f"/v1/sagas/{saga_id}/complete"))
    assert completed["status"] == "completed"
    assert completed["version"] == 6
    assert completed["started_at"] == created["started_at"]
    assert completed["updated_at"] > created["updated_at"]

    detail = await ok(await callers["dashboard"].get(f"/v1/sagas/{saga_id}"))
    assert {k: v for k, v in detail.items() if k != "timeline"} == completed
    assert [e["type"] for e in detail["timeline"]] == [
        "SAGA_STARTED", "STEP_STARTED", "STEP_COMPLETED", "STEP_STARTED", "STEP_COMPLETED", "SAGA_COMPLETED",
    ]  # fmt: skip
    assert [e["version"] for e in detail["timeline"]] == [1, 2, 3, 4, 5, 6]
    positions = [e["position"] for e in detail["timeline"]]
    assert positions == sorted(positions)
    # A completed saga is final.
    body = assert_problem(
        await agent.post(f"/v1/sagas/{saga_id}/abort", {"reason": "late"}), 409, "saga_conflict"
    )
    assert body["saga_status"] == "completed"
    assert body["expected_step"] is None


async def test_a_failing_step_is_compensated_in_reverse(
    callers: dict[str, Caller], unique_prefix: str
) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}fail"
    await create(agent, saga_id, "a", "b", "c")
    for name in ("a", "b"):
        await step(agent, saga_id, name, "start")
        await step(agent, saga_id, name, "complete", {"result": {"done": name}})
    await step(agent, saga_id, "c", "start")
    failed = await step(agent, saga_id, "c", "fail", {"reason": "gripper jammed"})
    assert failed["status"] == "compensating"
    assert failed["reason"] == "gripper jammed"
    assert failed["steps"][2]["status"] == "failed"
    assert failed["steps"][2]["error"] == "gripper jammed"

    # No step starts after a failure; compensation goes last completed first.
    assert_problem(await agent.post(f"/v1/sagas/{saga_id}/steps/c/start"), 409, "saga_conflict")
    refused = assert_problem(
        await agent.post(f"/v1/sagas/{saga_id}/steps/a/compensation/start"), 409, "saga_conflict"
    )
    assert refused["saga_status"] == "compensating"
    assert refused["expected_step"] == "b"
    await step(agent, saga_id, "b", "compensation/start")
    after_b = await step(agent, saga_id, "b", "compensation/complete")
    assert after_b["status"] == "compensating"
    await step(agent, saga_id, "a", "compensation/start")
    aborted = await step(agent, saga_id, "a", "compensation/complete")
    assert aborted["status"] == "aborted"
    assert [s["status"] for s in aborted["steps"]] == ["compensated", "compensated", "failed"]
    assert aborted["steps"][0]["result"] == {"done": "a"}  # kept for the compensation

    detail = await ok(await agent.get(f"/v1/sagas/{saga_id}"))
    compensated = [e["data"]["step"] for e in detail["timeline"] if e["type"] == "COMPENSATION_COMPLETED"]
    assert compensated == ["b", "a"]
    assert detail["timeline"][-1]["type"] == "SAGA_ABORTED"


async def test_repeated_transitions_change_nothing(callers: dict[str, Caller], unique_prefix: str) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}repeat"
    await create(agent, saga_id, "a", "b")
    first = await step(agent, saga_id, "a", "start")
    assert await step(agent, saga_id, "a", "start") == first
    done = await step(agent, saga_id, "a", "complete", {"result": {"x": 1}})
    assert await step(agent, saga_id, "a", "complete", {"result": {"x": 1}}) == done
    assert await timeline_types(agent, saga_id) == ["SAGA_STARTED", "STEP_STARTED", "STEP_COMPLETED"]

    # Idempotency-Key: the stored answer again, and nothing appended; the key for another request: 422.
    key = f"k-{uuid.uuid4()}"
    started = await agent.post(f"/v1/sagas/{saga_id}/steps/b/start", **{"Idempotency-Key": key})
    assert started.status_code == 200
    assert "Idempotent-Replayed" not in started.headers
    await step(agent, saga_id, "b", "complete")
    replayed = await agent.post(f"/v1/sagas/{saga_id}/steps/b/start", **{"Idempotency-Key": key})
    assert replayed.status_code == 200
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.json() == started.json()
    assert replayed.json()["steps"][1]["status"] == "running"  # the answer then, not the saga now
    reused = await agent.post(f"/v1/sagas/{saga_id}/complete", **{"Idempotency-Key": key})
    assert_problem(reused, 422, "idempotency_key_reused")
    assert (await timeline_types(agent, saga_id)).count("STEP_STARTED") == 2

    # The metadata of each event names the command, the actor, the saga and the key.
    detail = await ok(await agent.get(f"/v1/sagas/{saga_id}"))
    assert len(detail["timeline"]) == 5


async def test_a_transition_out_of_order_is_409(callers: dict[str, Caller], unique_prefix: str) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}order"
    await create(agent, saga_id, "a", "b")
    body = assert_problem(await agent.post(f"/v1/sagas/{saga_id}/steps/b/start"), 409, "saga_conflict")
    assert body["saga_status"] == "running"
    assert body["expected_step"] == "a"
    assert "a" in body["detail"]
    assert_problem(await agent.post(f"/v1/sagas/{saga_id}/steps/a/complete"), 409, "saga_conflict")
    assert_problem(await agent.post(f"/v1/sagas/{saga_id}/complete"), 409, "saga_conflict")
    assert_problem(await agent.post(f"/v1/sagas/{saga_id}/steps/zz/start"), 409, "saga_conflict")
    assert_problem(await agent.post(f"/v1/sagas/{unique_prefix}nope/steps/a/start"), 404, "not_found")
    assert_problem(await agent.get(f"/v1/sagas/{unique_prefix}nope"), 404, "not_found")
    assert await timeline_types(agent, saga_id) == ["SAGA_STARTED"]


async def test_limits(callers: dict[str, Caller], unique_prefix: str) -> None:
    agent = callers["agent"]
    too_many = definition(f"{unique_prefix}big", *[f"s{i}" for i in range(33)])
    assert_problem(await agent.post("/v1/sagas", too_many), 422, "validation_error")
    wide = {"name": "n", "steps": [{"name": "a", "locks": [f"r{i}" for i in range(17)]}]}
    assert_problem(await agent.post("/v1/sagas", wide), 422, "validation_error")
    twice = {"name": "n", "steps": [{"name": "a", "locks": []}, {"name": "a", "locks": []}]}
    assert_problem(await agent.post("/v1/sagas", twice), 409, "conflict")
    saga_id = f"{unique_prefix}limit"
    await create(agent, saga_id, "a")
    await step(agent, saga_id, "a", "start")
    large = {"result": {"blob": "x" * 4100}}
    assert_problem(await agent.post(f"/v1/sagas/{saga_id}/steps/a/complete", large), 422, "validation_error")
    # A server-made id when none is sent; a create retried under its Idempotency-Key finds the same saga.
    made = await agent.post("/v1/sagas", {"name": "n", "steps": [{"name": "a"}]})
    assert made.status_code == 201
    assert made.json()["saga_id"]
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    first = await agent.post("/v1/sagas", {"name": "n", "steps": [{"name": "a"}]}, **key)
    retried = await agent.post("/v1/sagas", {"name": "n", "steps": [{"name": "a"}]}, **key)
    assert (first.status_code, retried.status_code) == (201, 201)
    assert retried.headers["Idempotent-Replayed"] == "true"
    assert retried.json() == first.json()
    assert first.json()["saga_id"] != made.json()["saga_id"]


async def test_concurrent_transitions_append_once(callers: dict[str, Caller], unique_prefix: str) -> None:
    """Racing copies of one transition: the stream head's expected version lets one append; the others
    decide again on the saga it left and find the transition already happened."""
    agent = callers["agent"]
    saga_id = f"{unique_prefix}race"
    await create(agent, saga_id, "a", "b")
    answers = await asyncio.gather(*[agent.post(f"/v1/sagas/{saga_id}/steps/a/start") for _ in range(12)])
    assert [answer.status_code for answer in answers] == [200] * 12
    assert {answer.json()["version"] for answer in answers} == {2}
    creates = await asyncio.gather(
        *[agent.post("/v1/sagas", definition(f"{saga_id}-2", "a")) for _ in range(8)]
    )
    assert sorted(answer.status_code for answer in creates) == [200] * 7 + [201]
    assert await timeline_types(agent, saga_id) == ["SAGA_STARTED", "STEP_STARTED"]
    assert await timeline_types(agent, f"{saga_id}-2") == ["SAGA_STARTED"]


async def test_roles(callers: dict[str, Caller], unique_prefix: str) -> None:
    agent, other = callers["agent"], callers["other"]
    saga_id = f"{unique_prefix}roles"
    await create(agent, saga_id, "a", "b")
    # Another agent can neither drive, abort nor read it; it cannot start a saga as someone else.
    assert_problem(await other.post(f"/v1/sagas/{saga_id}/steps/a/start"), 403, "forbidden")
    assert_problem(await other.post(f"/v1/sagas/{saga_id}/abort", {"reason": "mine"}), 403, "forbidden")
    assert_problem(await other.get(f"/v1/sagas/{saga_id}"), 403, "forbidden")
    assert_problem(await other.get("/v1/sagas", owner=agent.name), 403, "forbidden")
    as_agent = {**definition(f"{unique_prefix}spoof", "a"), "owner": agent.name}
    assert_problem(await other.post("/v1/sagas", as_agent), 403, "forbidden")
    # Dashboards and investigators read, never drive.
    for reader in (callers["dashboard"], callers["investigator"]):
        assert (await ok(await reader.get(f"/v1/sagas/{saga_id}")))["owner"] == agent.name
        assert_problem(await reader.post(f"/v1/sagas/{saga_id}/steps/a/start"), 403, "forbidden")
        assert_problem(await reader.post("/v1/sagas", definition(f"{unique_prefix}r", "a")), 403, "forbidden")
    # The owner aborts its own; an admin aborts anyone's.
    await step(agent, saga_id, "a", "start")
    await step(agent, saga_id, "a", "complete")
    aborting = await ok(await agent.post(f"/v1/sagas/{saga_id}/abort", {"reason": "operator said so"}))
    assert aborting["status"] == "compensating"
    second = f"{unique_prefix}roles2"
    await create(other, second, "a")
    aborted = await ok(await callers["admin"].post(f"/v1/sagas/{second}/abort", {"reason": "maintenance"}))
    assert aborted["status"] == "aborted"  # nothing was completed, nothing to compensate
    assert aborted["reason"] == "maintenance"
    # Without a token: 401.
    unauthenticated = await agent.api.get(f"/v1/sagas/{saga_id}")
    assert_problem(unauthenticated, 401, "unauthorized")


async def test_stuck_after_the_fifth_failed_compensation(
    callers: dict[str, Caller], unique_prefix: str
) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}stuck"
    await create(agent, saga_id, "a", "b")
    await step(agent, saga_id, "a", "start")
    await step(agent, saga_id, "a", "complete")
    await step(agent, saga_id, "b", "start")
    await step(agent, saga_id, "b", "fail", {"reason": "dropped"})
    await step(agent, saga_id, "a", "compensation/start")
    for attempt in range(1, 5):
        view = await step(agent, saga_id, "a", "compensation/fail", {"reason": f"retry {attempt}"})
        assert view["status"] == "compensating"
        assert view["steps"][0]["compensation_failures"] == attempt
        await step(agent, saga_id, "a", "compensation/start")  # the retry: the step is still compensating
    stuck = await step(agent, saga_id, "a", "compensation/fail", {"reason": "arm offline"})
    assert stuck["status"] == "stuck"
    assert stuck["reason"] == "arm offline"
    assert stuck["steps"][0]["compensation_failures"] == 5
    # Final: nothing moves it, and the failure repeated appends nothing.
    assert_problem(
        await agent.post(f"/v1/sagas/{saga_id}/steps/a/compensation/complete"), 409, "saga_conflict"
    )
    assert await step(agent, saga_id, "a", "compensation/fail", {"reason": "arm offline"}) == stuck
    types = await timeline_types(agent, saga_id)
    assert types.count("COMPENSATION_FAILED") == 5
    assert types[-1] == "SAGA_STUCK"
    listed = await ok(await callers["dashboard"].get("/v1/sagas", status="stuck", owner=agent.name))
    assert [s["saga_id"] for s in listed["items"]] == [saga_id]


async def test_list_filters_and_pages(callers: dict[str, Caller], unique_prefix: str) -> None:
    agent, other, dashboard = callers["agent"], callers["other"], callers["dashboard"]
    name = f"{unique_prefix}batch"
    mine = [f"{unique_prefix}l{i}" for i in range(5)]
    for saga_id in mine:
        await create(agent, saga_id, "a", name=name)
    theirs = f"{unique_prefix}l9"
    await create(other, theirs, "a", name=name)
    await ok(await agent.post(f"/v1/sagas/{mine[1]}/abort", {"reason": "no"}))

    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"name": name, "limit": 2}
        if cursor is not None:
            params["cursor"] = cursor
        page = await ok(await dashboard.get("/v1/sagas", **params))
        assert len(page["items"]) <= 2
        seen += [s["saga_id"] for s in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted([*mine, theirs])

    running = await ok(await dashboard.get("/v1/sagas", name=name, status="running"))
    assert [s["saga_id"] for s in running["items"]] == sorted([m for m in mine if m != mine[1]] + [theirs])
    aborted = await ok(await dashboard.get("/v1/sagas", name=name, status="aborted"))
    assert [s["saga_id"] for s in aborted["items"]] == [mine[1]]
    by_owner = await ok(await dashboard.get("/v1/sagas", name=name, owner=other.name))
    assert [s["saga_id"] for s in by_owner["items"]] == [theirs]
    # An agent lists its own sagas only.
    own = await ok(await agent.get("/v1/sagas", name=name))
    assert [s["saga_id"] for s in own["items"]] == mine
    assert_problem(await dashboard.get("/v1/sagas", status="paused"), 422, "validation_error")
    assert_problem(await dashboard.get("/v1/sagas", colour="red"), 422, "validation_error")


async def test_a_lock_taken_within_a_saga_shows_it(
    callers: dict[str, Caller], unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    agent, dashboard, investigator = callers["agent"], callers["dashboard"], callers["investigator"]
    saga_id = f"{unique_prefix}locks"
    resource = f"{unique_prefix}pallet"
    await create(agent, saga_id, "pick")
    await step(agent, saga_id, "pick", "start")
    saga_headers = {"X-Saga-ID": saga_id, "X-Saga-Step": "pick"}
    acquired = await agent.post(f"/v1/locks/{resource}/acquire", {"ttl_ms": 60_000}, **saga_headers)
    assert acquired.status_code == 201, acquired.text
    token = acquired.json()["fencing_token"]
    plain = await agent.post(f"/v1/locks/{resource}b/acquire", {"ttl_ms": 60_000})
    assert plain.status_code == 201

    listed = await ok(await dashboard.get("/v1/locks", prefix=unique_prefix))
    by_resource = {item["resource"]: item for item in listed["items"]}
    assert (by_resource[resource]["saga_id"], by_resource[resource]["saga_step"]) == (saga_id, "pick")
    assert (by_resource[f"{resource}b"]["saga_id"], by_resource[f"{resource}b"]["saga_step"]) == (None, None)
    # A heartbeat without the headers keeps the lease's saga.
    renewed = await agent.post(f"/v1/locks/{resource}/renew", {"fencing_token": token})
    assert renewed.status_code == 200
    one = await ok(await dashboard.get(f"/v1/locks/{resource}"))
    assert (one["saga_id"], one["saga_step"]) == (saga_id, "pick")

    # Rebuild reproduces saga_state and the locks' saga columns. The tables are locked first, so the
    # server's reaper cannot expire another test's lease between the two snapshots.
    async with admin_pool.acquire() as conn, conn.transaction():
        await conn.execute("LOCK TABLE lock_state, saga_state IN EXCLUSIVE MODE")
        sagas_before = await conn.fetch("SELECT * FROM saga_state ORDER BY saga_id")
        locks_before = await conn.fetch("SELECT * FROM lock_state ORDER BY resource")
        await rebuild_lock_state(conn)
        assert await conn.fetch("SELECT * FROM saga_state ORDER BY saga_id") == sagas_before
        assert await conn.fetch("SELECT * FROM lock_state ORDER BY resource") == locks_before

    released = await agent.post(f"/v1/locks/{resource}/release", {"fencing_token": token}, **saga_headers)
    assert released.status_code == 200
    freed = await ok(await dashboard.get(f"/v1/locks/{resource}"))
    assert (freed["saga_id"], freed["saga_step"]) == (None, None)  # no live lease, no saga
    history = await ok(await investigator.get(f"/v1/locks/{resource}/history"))
    metadata = [
        (e["type"], e["metadata"].get("saga_id"), e["metadata"].get("saga_step")) for e in history["events"]
    ]
    assert metadata == [
        ("LOCK_ACQUIRED", saga_id, "pick"), ("LOCK_RENEWED", None, None), ("LOCK_RELEASED", saga_id, "pick"),
    ]  # fmt: skip
    bad = await agent.post(f"/v1/locks/{resource}/acquire", {"ttl_ms": 60_000}, **{"X-Saga-ID": "a/b"})
    assert_problem(bad, 422, "validation_error")


async def test_a_sagas_events_keep_the_hash_chain(
    callers: dict[str, Caller], unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}chain"
    await create(agent, saga_id, "a")
    await step(agent, saga_id, "a", "start")
    await step(agent, saga_id, "a", "complete", {"result": {"k": [1, 2]}})
    await ok(await agent.post(f"/v1/sagas/{saga_id}/complete", **{"X-Correlation-ID": "c-1"}))
    async with admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT stream_id, stream_version, event_id::text AS event_id, event_type, data::text AS data,"
            " metadata::text AS metadata, recorded_at, hash FROM events WHERE stream_id = $1"
            " ORDER BY stream_version",
            f"saga/{saga_id}",
        )
        previous = b""
        for row in rows:
            digest = event_hash(
                previous, row["stream_id"], row["stream_version"], row["event_id"], row["event_type"],
                row["data"], row["metadata"], row["recorded_at"],
            )  # fmt: skip
            assert digest == bytes(row["hash"])
            previous = digest
        assert [r["stream_version"] for r in rows] == [1, 2, 3, 4]
        last = json.loads(rows[-1]["metadata"])
        assert last["saga_id"] == saga_id
        assert last["actor"] == agent.name
        assert last["correlation_id"] == "c-1"
        assert last["command"] == "saga-complete"
        report = await verify_chains(conn)
        assert report.ok, report.broken


# --- the saga's lease -------------------------------------------------------------------------------------


async def _lapse_until(
    admin_pool: asyncpg.Pool, caller: Caller, saga_id: str, version: int
) -> dict[str, Any]:
    """Run the reaper's saga pass until the saga moves past ``version`` (its lease has 1 s to lapse)."""
    sagas = saga_service_on_pool(admin_pool, DatabaseGuard())
    for _ in range(100):
        async with admin_pool.acquire() as conn:
            due = await due_sagas(conn, 1000)
        await lapse_sagas(sagas, due, "test")
        view = await ok(await caller.get(f"/v1/sagas/{saga_id}"))
        if view["version"] > version:
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"saga {saga_id} never lapsed")


async def test_a_saga_whose_heartbeats_stop_is_compensated_then_stuck(
    callers: dict[str, Caller], unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}orphan"
    created = await ok_created(agent, {**definition(saga_id, "pick", "drive"), "lease_ms": 1000})
    assert created["lease_ms"] == 1000
    assert re.match(TIMESTAMP_PATTERN, created["lease_expires_at"])
    assert created["lease_lapsed_at"] is None
    await step(agent, saga_id, "pick", "start")
    await step(agent, saga_id, "pick", "complete", {"result": {"from": "dock:3"}})
    started = await step(agent, saga_id, "drive", "start")

    lapsed = await _lapse_until(admin_pool, agent, saga_id, started["version"])
    assert lapsed["status"] == "compensating"
    assert lapsed["steps"][1]["status"] == "failed"
    assert lapsed["steps"][1]["error"] == "saga lease lapsed: the orchestrator stopped heartbeating"
    assert re.match(TIMESTAMP_PATTERN, lapsed["lease_lapsed_at"])
    assert lapsed["lease_expires_at"] > lapsed["lease_lapsed_at"]  # another lease to compensate in
    assert [e["type"] for e in lapsed["timeline"]][-2:] == ["SAGA_LEASE_EXPIRED", "STEP_FAILED"]
    assert lapsed["timeline"][-2]["data"]["lapses"] == 1

    stuck = await _lapse_until(admin_pool, agent, saga_id, lapsed["version"])  # nobody compensated
    assert stuck["status"] == "stuck"
    assert stuck["reason"] == "saga lease lapsed twice: no orchestrator came back to finish it"
    assert stuck["lease_expires_at"] is None
    assert [e["type"] for e in stuck["timeline"]][-2:] == ["SAGA_LEASE_EXPIRED", "SAGA_STUCK"]
    assert_problem(await agent.post(f"/v1/sagas/{saga_id}/heartbeat"), 409, "saga_conflict")
    async with admin_pool.acquire() as conn:
        assert (await verify_chains(conn)).ok


async def test_a_heartbeat_renews_the_lease_and_only_the_owner_sends_it(
    callers: dict[str, Caller], unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}alive"
    created = await ok_created(agent, {**definition(saga_id, "pick"), "lease_ms": 60_000})
    beat = await ok(await agent.post(f"/v1/sagas/{saga_id}/heartbeat"))
    assert beat["version"] == created["version"] + 1
    assert beat["lease_expires_at"] > created["lease_expires_at"]
    assert beat["status"] == "running"
    async with admin_pool.acquire() as conn:  # a live lease: the reaper's pass leaves it alone
        due = await due_sagas(conn, 1000)
    assert saga_id not in [found.saga_id for found in due]
    await lapse_sagas(saga_service_on_pool(admin_pool, DatabaseGuard()), due, "test")
    assert (await ok(await agent.get(f"/v1/sagas/{saga_id}")))["version"] == beat["version"]
    assert await timeline_types(agent, saga_id) == ["SAGA_STARTED", "SAGA_LEASE_RENEWED"]
    assert_problem(await callers["other"].post(f"/v1/sagas/{saga_id}/heartbeat"), 403, "forbidden")
    assert_problem(await callers["dashboard"].post(f"/v1/sagas/{saga_id}/heartbeat"), 403, "forbidden")
    assert_problem(await agent.post(f"/v1/sagas/{unique_prefix}none/heartbeat"), 404, "not_found")


async def test_the_lease_is_bounded_like_a_lock_ttl_and_defaults_to_it(
    callers: dict[str, Caller], unique_prefix: str, api: httpx.AsyncClient
) -> None:
    agent = callers["agent"]
    for lease_ms in (999, 3_600_001):
        refused = await agent.post(
            "/v1/sagas", {**definition(f"{unique_prefix}b{lease_ms}", "a"), "lease_ms": lease_ms}
        )
        assert_problem(refused, 422, "validation_error")
    assert (await create(agent, f"{unique_prefix}default", "a"))["lease_ms"] == 30_000
    schema = (await api.get("/openapi.json")).json()["components"]["schemas"]["CreateSagaRequest"]
    bounds = next(b for b in schema["properties"]["lease_ms"]["anyOf"] if b.get("type") == "integer")
    assert (bounds["minimum"], bounds["maximum"]) == (1000, 3_600_000)


async def test_rebuild_reproduces_the_lease_columns(
    callers: dict[str, Caller], unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    agent = callers["agent"]
    saga_id = f"{unique_prefix}rebuilt"
    await ok_created(agent, {**definition(saga_id, "a"), "lease_ms": 1000})
    await step(agent, saga_id, "a", "start")
    view = await ok(await agent.post(f"/v1/sagas/{saga_id}/heartbeat"))
    await _lapse_until(admin_pool, agent, saga_id, view["version"])
    columns = "saga_id, version, status, reason, steps, lease_ms, lease_expires_at, lease_lapsed_at"
    async with admin_pool.acquire() as conn, conn.transaction():
        before = await conn.fetch(f"SELECT {columns} FROM saga_state ORDER BY saga_id")
        await rebuild_saga_state(conn)
        after = await conn.fetch(f"SELECT {columns} FROM saga_state ORDER BY saga_id")
        assert [dict(r) for r in after] == [dict(r) for r in before]
        mine = next(r for r in after if r["saga_id"] == saga_id)
        assert mine["lease_lapsed_at"] is not None
