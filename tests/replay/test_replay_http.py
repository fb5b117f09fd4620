"""The replay endpoints over HTTP against a real server: state at an instant, changes, timelines, export."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from api.models import ReplayLease, ReplayState
from api.replay import state_json
from domain.access import Role
from projections.replay import LiveLease, StateAt
from tests.assertions import assert_problem
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


async def _db_now(admin_pool: asyncpg.Pool) -> datetime:
    now: datetime = await admin_pool.fetchval("SELECT clock_timestamp()")
    return now


async def _acquire(
    http: httpx.AsyncClient, resource: str, owner: str, ttl_ms: int = 30_000
) -> dict[str, Any]:
    answer = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": owner, "ttl_ms": ttl_ms})
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


async def test_state_at_an_instant_shows_the_lease_then_and_not_before_or_after(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    resource = f"{unique_prefix}zone:A3"
    before = await _db_now(admin_pool)
    lease = await _acquire(http, resource, "agv-17")
    renewed = await http.post(
        f"/v1/locks/{resource}/renew", json={"owner": "agv-17", "fencing_token": lease["fencing_token"]}
    )
    assert renewed.status_code == 200
    held = await _db_now(admin_pool)
    released = await http.post(
        f"/v1/locks/{resource}/release", json={"owner": "agv-17", "fencing_token": lease["fencing_token"]}
    )
    assert released.status_code == 200
    after = await _db_now(admin_pool)

    async def state(at: datetime) -> dict[str, Any]:
        answer = await http.get("/v1/replay/state", params={"at": at.isoformat(), "prefix": unique_prefix})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    assert (await state(before))["locks"] == []
    during = await state(held)
    assert [(lock["resource"], lock["owner"], lock["fencing_token"]) for lock in during["locks"]] == [
        (resource, "agv-17", lease["fencing_token"])
    ]
    assert during["locks"][0]["expires_at"] == renewed.json()["expires_at"]  # the deadline known then
    assert during["locks"][0]["acquired_at"] <= during["locks"][0]["expires_at"]
    assert during["position"] > 0
    assert (await state(after))["locks"] == []


async def test_a_future_instant_is_refused(http: httpx.AsyncClient, admin_pool: asyncpg.Pool) -> None:
    future = await _db_now(admin_pool) + timedelta(hours=1)
    answer = await http.get("/v1/replay/state", params={"at": future.isoformat()})
    problem = assert_problem(answer, 422, "validation_error")
    assert "future" in json.dumps(problem)
    naive = await http.get("/v1/replay/state", params={"at": "2026-05-05T14:02:07"})
    assert_problem(naive, 422, "validation_error")


async def test_changes_list_events_and_unrecorded_lapses_in_time_order(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    start = await _db_now(admin_pool)
    short = f"{unique_prefix}pallet:42"
    kept = f"{unique_prefix}zone:B1"
    await _acquire(http, short, "agv-1", ttl_ms=1_000)
    await _acquire(http, kept, "agv-2")
    await asyncio.sleep(1.2)
    end = await _db_now(admin_pool)
    answer = await http.get(
        "/v1/replay/changes",
        params={"from": start.isoformat(), "to": end.isoformat(), "prefix": unique_prefix},
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    kinds = [(c["type"], c["resource"]) for c in body["changes"]]
    # The short lease lapsed; whether the reaper recorded LOCK_EXPIRED before `end` decides which shows.
    assert kinds[:2] == [("LOCK_ACQUIRED", short), ("LOCK_ACQUIRED", kept)]
    assert kinds[2:] in ([("LEASE_LAPSED", short)], [("LOCK_EXPIRED", short)])
    ats = [c["at"] for c in body["changes"]]
    assert ats == sorted(ats)


async def _paged(http: httpx.AsyncClient, path: str, key: str, params: dict[str, str]) -> list[Any]:
    """Every item of ``path``'s pages, one a page, following ``next_cursor``."""
    items: list[Any] = []
    cursor = None
    while True:
        answer = await http.get(
            path, params={**params, "limit": "1", **({"cursor": cursor} if cursor else {})}
        )
        assert answer.status_code == 200, answer.text
        items += answer.json()[key]
        cursor = answer.json()["next_cursor"]
        if cursor is None:
            return items


async def test_shared_grants_in_state_and_changes_page_by_page(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    """A mutex and two grants of the semaphore of the same name, one left to lapse: the state lists the
    mutex lease, then the grants by token with mode and limit, one a page; the changes name the shared
    lock's stream, the lapse included, and their cursor crosses its events."""
    resource = f"{unique_prefix}bay"
    start = await _db_now(admin_pool)
    await _acquire(http, resource, "agv-1")
    tokens = []
    for owner, ttl_ms in (("agv-2", 30_000), ("agv-3", 1_000)):
        granted = await http.post(
            f"/v1/shared-locks/{resource}/acquire",
            json={"owner": owner, "mode": "shared", "limit": 2, "ttl_ms": ttl_ms},
        )
        assert granted.status_code == 201, granted.text
        tokens.append(granted.json()["fencing_token"])
    held = await _db_now(admin_pool)
    await asyncio.sleep(1.2)
    end = await _db_now(admin_pool)

    locks = await _paged(http, "/v1/replay/state", "locks", {"at": held.isoformat(), "prefix": unique_prefix})
    assert [(lock["resource"], lock["owner"], lock["mode"], lock["limit"]) for lock in locks] == [
        (resource, "agv-1", None, None), (resource, "agv-2", "shared", 2), (resource, "agv-3", "shared", 2),
    ]  # fmt: skip
    assert [lock["fencing_token"] for lock in locks[1:]] == tokens
    later = await _paged(http, "/v1/replay/state", "locks", {"at": end.isoformat(), "prefix": unique_prefix})
    assert [lock["owner"] for lock in later] == ["agv-1", "agv-2"]

    window = {"from": start.isoformat(), "to": end.isoformat(), "prefix": unique_prefix}
    changes = await _paged(http, "/v1/replay/changes", "changes", window)
    kinds = [(c["type"], c["resource"], c["owner"]) for c in changes]
    stream = f"shared/{resource}"
    assert kinds[:3] == [
        ("LOCK_ACQUIRED", resource, "agv-1"), ("SHARED_ACQUIRED", stream, "agv-2"),
        ("SHARED_ACQUIRED", stream, "agv-3"),
    ]  # fmt: skip
    # The short grant lapsed; whether the reaper recorded SHARED_EXPIRED before `end` decides which shows.
    assert kinds[3:] in ([("LEASE_LAPSED", stream, "agv-3")], [("SHARED_EXPIRED", stream, "agv-3")])


async def test_agent_history_and_resource_history_by_time(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    agent = f"agv-{unique_prefix[:-1]}"
    first, second = f"{unique_prefix}a", f"{unique_prefix}b"
    await _acquire(http, first, agent)
    middle = await _db_now(admin_pool)
    await _acquire(http, second, agent)
    everything = await http.get(f"/v1/agents/{agent}/history")
    assert [e["resource"] for e in everything.json()["events"]] == [first, second]
    later = await http.get(f"/v1/agents/{agent}/history", params={"from": middle.isoformat()})
    assert [e["resource"] for e in later.json()["events"]] == [second]
    timeline = await http.get(f"/v1/locks/{first}/history", params={"to": middle.isoformat()})
    assert [e["type"] for e in timeline.json()["events"]] == ["LOCK_ACQUIRED"]
    none = await http.get(f"/v1/locks/{first}/history", params={"from": middle.isoformat()})
    assert none.json()["events"] == []


async def test_export_streams_ndjson_and_resumes(http: httpx.AsyncClient, unique_prefix: str) -> None:
    for index in range(5):
        await _acquire(http, f"{unique_prefix}r{index}", "agv-x")
    async with http.stream("GET", "/v1/events", params={"prefix": unique_prefix}) as answer:
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) async for line in answer.aiter_lines() if line]
    assert [line["stream"] for line in lines] == [f"{unique_prefix}r{i}" for i in range(5)]
    positions = [line["position"] for line in lines]
    assert positions == sorted(positions)
    assert set(lines[0]) >= {"position", "stream", "version", "type", "data", "recorded_at", "hash"}
    resumed = await http.get("/v1/events", params={"prefix": unique_prefix, "after_position": positions[1]})
    assert [json.loads(line)["position"] for line in resumed.text.splitlines()] == positions[2:]


async def test_the_history_needs_the_investigator_role(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    """The export and an agent's timeline are the investigator's; the fleet at an instant is also the
    dashboard's (tests/storage/test_auth.py holds every role to every endpoint)."""
    dashboard = await issue_token(f"{unique_prefix}dash", Role.DASHBOARD)
    investigator = await issue_token(f"{unique_prefix}inv", Role.INVESTIGATOR)
    async with httpx.AsyncClient(base_url=auth_server.base_url) as client:
        for path in ("/v1/events", "/v1/agents/a/history"):
            refused = await client.get(path, headers={"Authorization": f"Bearer {dashboard}"})
            assert refused.status_code == 403, path
            allowed = await client.get(path, headers={"Authorization": f"Bearer {investigator}"})
            assert allowed.status_code == 200, (path, allowed.text)


# Every endpoint that takes an instant, the parameter, and the other parameters it needs.
INSTANT_PARAMETERS = [
    ("/v1/replay/state", "at", {}),
    ("/v1/replay/changes", "from", {"to": "2026-01-02T00:00:00Z"}),
    ("/v1/replay/changes", "to", {"from": "0001-01-01T00:00:00Z"}),
    ("/v1/agents/agv-1/history", "from", {}),
    ("/v1/agents/agv-1/history", "to", {}),
    ("/v1/events", "from", {}),
    ("/v1/events", "to", {}),
    ("/v1/locks/zone:A3/history", "from", {}),
    ("/v1/locks/zone:A3/history", "to", {}),
    ("/v1/shared-locks/zone:A3/history", "from", {}),
    ("/v1/shared-locks/zone:A3/history", "to", {}),
]


@pytest.mark.parametrize(("path", "parameter", "others"), INSTANT_PARAMETERS)
@pytest.mark.parametrize(
    ("instant", "why"),
    [
        ("0001-01-01T00:00:00+14:00", "outside years 1 to 9999"),  # 0000-12-31T10:00Z
        ("0001-01-01T00:00:00.0+00:01", "outside years 1 to 9999"),
        ("9999-12-31T23:59:59.999999-00:01", "outside years 1 to 9999"),
        ("2026-05-05T09:30:00.1234567Z", "at most 6 fractional digits"),
        ("2026-05-05T09:30:00.0000001+02:00", "at most 6 fractional digits"),
    ],
)
async def test_an_instant_utc_cannot_write_or_finer_than_a_microsecond_is_422(
    http: httpx.AsyncClient, path: str, parameter: str, others: dict[str, str], instant: str, why: str
) -> None:
    """Like any other instant out of range: not moved to year 1 or 9999, not cut to microseconds."""
    answer = await http.get(path, params={**others, parameter: instant})
    problem = assert_problem(answer, 422, "validation_error")
    assert [error["loc"] for error in problem["errors"]] == [["query", parameter]]
    assert why in problem["detail"]


@pytest.mark.parametrize(("path", "parameter", "others"), INSTANT_PARAMETERS)
@pytest.mark.parametrize(
    "instant",
    ["0001-01-01T00:00:00Z", "0001-01-01T14:00:00+14:00", "2026-01-01T00:00:00.250000000000Z"],
)
async def test_the_first_instant_utc_writes_and_zeros_past_the_microsecond_are_taken(
    http: httpx.AsyncClient, path: str, parameter: str, others: dict[str, str], instant: str
) -> None:
    answer = await http.get(path, params={**others, parameter: instant})
    assert answer.status_code == 200, answer.text
    if path == "/v1/replay/state":
        assert (answer.json()["locks"], answer.json()["position"]) == ([], 0)


async def test_the_last_instant_utc_writes_is_taken_where_the_future_is_allowed(
    http: httpx.AsyncClient,
) -> None:
    last = "9999-12-31T23:59:59.999999Z"
    for path in (
        "/v1/agents/agv-1/history",
        "/v1/events",
        "/v1/locks/zone:A3/history",
        "/v1/shared-locks/zone:A3/history",
    ):
        answer = await http.get(path, params={"to": last})
        assert answer.status_code == 200, (path, answer.text)
    future = await http.get("/v1/replay/state", params={"at": "9999-12-31T09:59:59.999999-14:00"})
    assert_problem(future, 422, "validation_error")  # in range, but the state of the future is unknown
    assert "outside years" not in future.json()["detail"]


async def test_the_state_is_rendered_as_its_response_model_renders_it(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    await http.post(
        f"/v1/locks/{unique_prefix}zone:A3/acquire",
        json={"owner": "agv-7", "ttl_ms": 30_000},
        headers={"X-Saga-ID": "s-1", "X-Saga-Step": "pick"},
    )
    for zone in ("B1", "B2"):
        await _acquire(http, f"{unique_prefix}zone:{zone}", "agv-8")
    at = await _db_now(admin_pool)
    answer = await http.get(
        "/v1/replay/state", params={"at": at.isoformat(), "prefix": unique_prefix, "limit": 2}
    )
    assert answer.status_code == 200, answer.text
    model = ReplayState.model_validate_json(answer.content)
    assert answer.json() == json.loads(model.model_dump_json())
    assert [(lease.saga_id, lease.saga_step) for lease in model.locks] == [("s-1", "pick"), (None, None)]
    assert model.next_cursor == f"{unique_prefix}zone:B1"


def test_a_lease_whose_acquire_is_archived_is_rendered_as_the_model_renders_it() -> None:
    at = datetime(2026, 5, 5, 14, 2, 7, 123456, tzinfo=UTC)
    lease = LiveLease("zone:A3", "agv-7", 12, None, at + timedelta(microseconds=10), "s-1", "pick", "trip-9")
    locks = json.dumps([{**asdict(lease), "expires_at": "2026-05-05T14:02:07.123466Z"}])
    found = StateAt(at, 99, locks, next_cursor=None)
    model = ReplayState(
        at=at, position=99, locks=[ReplayLease.model_validate(lease, from_attributes=True)], next_cursor=None
    )
    assert json.loads(state_json(found)) == json.loads(model.model_dump_json())
    assert found.locks == [lease]
