"""The HTTP contract, end to end: problem+json on every error path, the query API, health and OpenAPI.

DESIGN.md, "Errors": ``application/problem+json`` (RFC 9457) with a stable ``code``; no input, however
malformed, yields a 500. Every check here runs against the real ``lockledger serve`` subprocess.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.assertions import assert_problem

pytestmark = pytest.mark.storage


def ts(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    assert parsed.tzinfo is not None, value
    return parsed


async def acquire(
    http: httpx.AsyncClient, resource: str, owner: str = "bot1", ttl_ms: int = 20_000
) -> dict[str, Any]:
    response = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": owner, "ttl_ms": ttl_ms})
    assert response.status_code == 201, response.text
    lease: dict[str, Any] = response.json()
    return lease


async def event_types(admin_pool: asyncpg.Pool, resource: str) -> list[str]:
    rows = await admin_pool.fetch(
        "SELECT event_type FROM events WHERE stream_id = $1 ORDER BY stream_version", resource
    )
    return [row["event_type"] for row in rows]


# --- 409 / 410: the lock's own rejections ------------------------------------------------------------


async def test_lock_held_names_holder_deadline_and_token(http: httpx.AsyncClient, resource: str) -> None:
    lease = await acquire(http, resource, "bot1")
    for owner in ("bot2", "bot1"):  # locks are not re-entrant: the holder itself is refused too
        held = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": owner})
        problem = assert_problem(held, 409, "lock_held")
        assert problem["holder"] == "bot1"
        assert problem["fencing_token"] == lease["fencing_token"]
        assert ts(problem["expires_at"]) == ts(lease["expires_at"])
        assert problem["resource"] == resource
        assert problem["instance"] == f"/v1/locks/{resource}/acquire"


async def test_not_holder_for_wrong_token_or_owner(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    lease = await acquire(http, resource, "bot1")
    token = lease["fencing_token"]
    wrong = [
        {"owner": "bot1", "fencing_token": token + 1},
        {"owner": "bot2", "fencing_token": token},
        {"owner": "bot2", "fencing_token": token + 1},
    ]
    for command in ("renew", "release"):
        for body in wrong:
            response = await http.post(f"/v1/locks/{resource}/{command}", json=body)
            problem = assert_problem(response, 409, "not_holder")
            assert problem["resource"] == resource
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]

    # A lock nobody ever took has no holder either, and asking does not create its stream.
    never = f"{resource}-never"
    renew = await http.post(f"/v1/locks/{never}/renew", json={"owner": "bot1", "fencing_token": 1})
    assert_problem(renew, 409, "not_holder")
    assert_problem(await http.get(f"/v1/locks/{never}"), 404, "not_found")


async def test_renew_after_the_deadline_is_lease_expired(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    lease = await acquire(http, resource, "bot1", ttl_ms=1_000)
    body = {"owner": "bot1", "fencing_token": lease["fencing_token"]}
    await asyncio.sleep(1.2)  # let the 1 s lease lapse (the database clock decides, not this one)

    for command in ("renew", "release"):
        expired = await http.post(f"/v1/locks/{resource}/{command}", json=body)
        problem = assert_problem(expired, 410, "lease_expired")
        assert ts(problem["expired_at"]) == ts(lease["expires_at"])

    # The reaper (every 100 ms in the test server) records the expiry; bounded wait for it.
    deadline = time.monotonic() + 10
    while (view := (await http.get(f"/v1/locks/{resource}")).json())["status"] != "free":
        assert view["status"] == "expired", view  # past the deadline: never "held" again
        assert time.monotonic() < deadline, "the reaper did not expire the lease"
        await asyncio.sleep(0.05)
    assert view["ended_by"] == "LOCK_EXPIRED"
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED", "LOCK_EXPIRED"]
    # Still expired, never resurrected; the next holder gets a larger token.
    assert_problem(await http.post(f"/v1/locks/{resource}/renew", json=body), 410, "lease_expired")
    assert (await acquire(http, resource, "bot2"))["fencing_token"] > lease["fencing_token"]


# --- 422: validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ttl_ms", [999, 3_600_001, 0, -1])
async def test_ttl_out_of_bounds_is_rejected(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, ttl_ms: int
) -> None:
    response = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": ttl_ms})
    assert_problem(response, 422, "validation_error")
    assert await event_types(admin_pool, resource) == []

    lease = await acquire(http, resource, "bot1")
    renew = await http.post(
        f"/v1/locks/{resource}/renew",
        json={"owner": "bot1", "fencing_token": lease["fencing_token"], "ttl_ms": ttl_ms},
    )
    assert_problem(renew, 422, "validation_error")
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]


@pytest.mark.parametrize("ttl_ms", [1_000, 3_600_000])
async def test_ttl_bounds_are_inclusive(http: httpx.AsyncClient, resource: str, ttl_ms: int) -> None:
    lease = await acquire(http, resource, "bot1", ttl_ms=ttl_ms)
    assert lease["ttl_ms"] == ttl_ms


@pytest.mark.parametrize(
    "path_resource",
    ["bad%20name", "a" * 201, "caf%C3%A9", "semi%3Bcolon", "star*"],
    ids=["space", "201-chars", "non-ascii", "semicolon", "star"],
)
async def test_bad_resource_in_path(http: httpx.AsyncClient, path_resource: str) -> None:
    acquired = await http.post(f"/v1/locks/{path_resource}/acquire", json={"owner": "bot1"})
    problem = assert_problem(acquired, 422, "validation_error")
    assert any(error["loc"][:2] == ["path", "resource"] for error in problem["errors"]), problem
    assert_problem(await http.get(f"/v1/locks/{path_resource}"), 422, "validation_error")
    assert_problem(await http.get(f"/v1/locks/{path_resource}/history"), 422, "validation_error")


async def test_resource_of_200_chars_is_accepted(http: httpx.AsyncClient, unique_prefix: str) -> None:
    resource = unique_prefix + "x" * (200 - len(unique_prefix))
    assert (await acquire(http, resource))["resource"] == resource


async def test_slash_in_resource_never_reaches_a_command(http: httpx.AsyncClient) -> None:
    # %2F decodes to "/", so the path no longer matches any route: a 404 problem, not a 500.
    response = await http.post("/v1/locks/a%2Fb/acquire", json={"owner": "bot1"})
    assert_problem(response, 404, "not_found")


def _errors_at(problem: dict[str, Any], *loc: str) -> list[dict[str, Any]]:
    return [e for e in problem["errors"] if tuple(e["loc"][: len(loc)]) == loc]


async def test_unknown_body_field_is_rejected(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    response = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "colour": "red"})
    problem = assert_problem(response, 422, "validation_error")
    assert _errors_at(problem, "body", "colour")
    assert await event_types(admin_pool, resource) == []


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"{not json", "application/json"),
        (b"", "application/json"),
        (b"[1, 2]", "application/json"),
        (b"\xff\xfe\x00", "application/json"),
    ],
    ids=["broken-json", "empty", "json-array", "binary"],
)
async def test_non_json_body_is_rejected(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, content: bytes, content_type: str
) -> None:
    response = await http.post(
        f"/v1/locks/{resource}/acquire", content=content, headers={"Content-Type": content_type}
    )
    assert_problem(response, 422, "validation_error")
    assert await event_types(admin_pool, resource) == []


@pytest.mark.parametrize(
    ("headers", "said"),
    [
        ({}, "this request has no Content-Type"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, "application/x-www-form-urlencoded"),
        ({"Content-Type": "text/plain"}, "text/plain"),
    ],
    ids=["no-content-type", "form", "text"],
)
async def test_a_body_not_sent_as_json_is_415(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, headers: dict[str, str], said: str
) -> None:
    """Even a body that is JSON: the media type says what the content is (RFC 9110, 415)."""
    for path in (f"/v1/locks/{resource}/acquire", "/v1/tokens"):
        response = await http.post(path, content=b'{"owner": "bot1"}', headers=headers)
        problem = assert_problem(response, 415, "unsupported_media_type")
        assert "must be JSON, sent with Content-Type: application/json" in problem["detail"]
        assert said in problem["detail"]
    assert await event_types(admin_pool, resource) == []


@pytest.mark.parametrize(
    "body",
    [{}, {"ttl_ms": 5_000}, {"owner": ""}, {"owner": "bot 1"}, {"owner": None}, {"owner": 42}],
    ids=["empty", "missing-owner", "empty-owner", "space-in-owner", "null-owner", "number-owner"],
)
async def test_bad_owner_is_rejected(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, body: dict[str, Any]
) -> None:
    response = await http.post(f"/v1/locks/{resource}/acquire", json=body)
    problem = assert_problem(response, 422, "validation_error")
    assert _errors_at(problem, "body", "owner"), problem
    assert await event_types(admin_pool, resource) == []


@pytest.mark.parametrize("token", [-1, 0, 2**62 + 1, "one", None])
async def test_bad_fencing_token_is_rejected(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, token: Any
) -> None:
    lease = await acquire(http, resource)
    assert lease["fencing_token"] == 1
    for command in ("renew", "release"):
        response = await http.post(
            f"/v1/locks/{resource}/{command}", json={"owner": "bot1", "fencing_token": token}
        )
        problem = assert_problem(response, 422, "validation_error")
        assert _errors_at(problem, "body", "fencing_token"), problem
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]


async def test_idempotency_key_length(
    http: httpx.AsyncClient, unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    too_long, longest = f"{unique_prefix}a", f"{unique_prefix}b"
    key = unique_prefix + "k" * (256 - len(unique_prefix))
    response = await http.post(
        f"/v1/locks/{too_long}/acquire", json={"owner": "bot1"}, headers={"Idempotency-Key": key}
    )
    problem = assert_problem(response, 422, "validation_error")
    assert any("idempotency-key" in str(e["loc"]).lower() for e in problem["errors"]), problem
    assert await event_types(admin_pool, too_long) == []

    accepted = await http.post(
        f"/v1/locks/{longest}/acquire", json={"owner": "bot1"}, headers={"Idempotency-Key": key[:255]}
    )
    assert accepted.status_code == 201, accepted.text


@pytest.mark.parametrize("header", ["X-Correlation-ID", "X-Causation-ID"])
async def test_trace_header_length(
    http: httpx.AsyncClient, unique_prefix: str, admin_pool: asyncpg.Pool, header: str
) -> None:
    too_long, longest = f"{unique_prefix}a", f"{unique_prefix}b"
    response = await http.post(
        f"/v1/locks/{too_long}/acquire", json={"owner": "bot1"}, headers={header: "c" * 201}
    )
    problem = assert_problem(response, 422, "validation_error")
    assert [e["loc"] for e in problem["errors"]] == [["header", header]]
    assert await event_types(admin_pool, too_long) == []
    accepted = await http.post(
        f"/v1/locks/{longest}/acquire", json={"owner": "bot1"}, headers={header: "c" * 200}
    )
    assert accepted.status_code == 201, accepted.text


async def test_every_invalid_part_of_a_command_is_reported_at_once(http: httpx.AsyncClient) -> None:
    response = await http.post(
        "/v1/locks/.../renew",
        json={"owner": "bot 1", "fencing_token": 0, "colour": "red"},
        headers={"Content-Type": "application/json"},
    )
    problem = assert_problem(response, 422, "validation_error")
    assert {tuple(e["loc"]) for e in problem["errors"]} == {
        ("path", "resource"),
        ("body", "owner"),
        ("body", "fencing_token"),
        ("body", "colour"),
    }


async def test_a_json_body_under_a_json_suffix_media_type_is_accepted(
    http: httpx.AsyncClient, resource: str
) -> None:
    response = await http.post(
        f"/v1/locks/{resource}/acquire",
        content=b'{"owner": "bot1"}',
        headers={"Content-Type": "application/vnd.lockledger+json; charset=utf-8"},
    )
    assert response.status_code == 201, response.text


async def test_force_release_needs_a_reason(http: httpx.AsyncClient, resource: str) -> None:
    await acquire(http, resource)
    for body in ({}, {"reason": ""}, {"reason": "x" * 1001}, {"reason": "ok", "by": "me"}):
        response = await http.post(f"/v1/locks/{resource}/force-release", json=body)
        assert_problem(response, 422, "validation_error")
    assert (await http.get(f"/v1/locks/{resource}")).json()["status"] == "held"


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=1001",
        "limit=ten",
        "expiring_within_ms=-1",
        "cursor=bad%20cursor",
        "holder=bad%20owner",
    ],
)
async def test_bad_list_query_is_rejected(http: httpx.AsyncClient, query: str) -> None:
    assert_problem(await http.get(f"/v1/locks?{query}"), 422, "validation_error")


async def test_bad_history_query_is_rejected(http: httpx.AsyncClient, resource: str) -> None:
    await acquire(http, resource)
    for query in ("after_version=-1", "limit=0", "limit=1001", "after_version=x", f"after_version={2**63}"):
        assert_problem(await http.get(f"/v1/locks/{resource}/history?{query}"), 422, "validation_error")
    # The largest version a stream can have is still a valid (empty) page.
    last = await http.get(f"/v1/locks/{resource}/history", params={"after_version": 2**63 - 1})
    assert last.status_code == 200
    assert last.json()["events"] == []


async def test_malformed_inputs_never_yield_a_500(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    """Inputs that once reached PostgreSQL and failed there (a 500): now each is a 422 before it does."""
    lease = await acquire(http, resource)
    # A version beyond bigint (asyncpg cannot even bind it).
    history = await http.get(f"/v1/locks/{resource}/history", params={"after_version": 10**30})
    assert_problem(history, 422, "validation_error")
    # NUL cannot be stored in PostgreSQL text or jsonb: the append of the force-release would fail.
    nul = await http.post(f"/v1/locks/{resource}/force-release", json={"reason": "stuck\u0000here"})
    assert_problem(nul, 422, "validation_error")
    # A body that is not even UTF-8 (FastAPI's own answer would be a 400).
    binary = await http.post(
        f"/v1/locks/{resource}/acquire",
        content=b'{"owner": "\xff"}',
        headers={"Content-Type": "application/json"},
    )
    assert_problem(binary, 422, "validation_error")
    view = (await http.get(f"/v1/locks/{resource}")).json()
    assert view["status"] == "held"
    assert view["fencing_token"] == lease["fencing_token"]
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]


# --- 404 / 405 ---------------------------------------------------------------------------------------


async def test_never_locked_resource_is_404(http: httpx.AsyncClient, resource: str) -> None:
    problem = assert_problem(await http.get(f"/v1/locks/{resource}"), 404, "not_found")
    assert problem["instance"] == f"/v1/locks/{resource}"


@pytest.mark.parametrize(
    "path", ["/nope", "/v1/nope", "/v2/locks", "/v1/locks/r1/unknown", "/v1/locks/r1/acquire/x"]
)
async def test_unknown_path_is_404(http: httpx.AsyncClient, path: str) -> None:
    for method in ("GET", "POST"):
        assert_problem(await http.request(method, path), 404, "not_found")


@pytest.mark.parametrize(
    "path",
    [
        "/v1/locks/a/b/acquire",
        "/v1/locks/a%2Fb/acquire",
        "/v1/locks/a/b",
        "/v1/locks/%2F",
        "/v1/locks/%2F/history",
        "/v1/locks/",
    ],
)
async def test_a_slash_in_a_resource_is_a_404_that_says_why(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, path: str
) -> None:
    for method in ("GET", "POST"):
        response = await http.request(method, path, json={"owner": "bot1"})  # never a redirect
        problem = assert_problem(response, 404, "not_found")
        assert "a resource id is exactly one path segment" in problem["detail"]
        assert "A-Z, a-z, 0-9 and . _ : -" in problem["detail"]
        assert "no '/'" in problem["detail"]
    assert await event_types(admin_pool, "a/b") == []


async def test_a_trailing_slash_is_not_redirected(http: httpx.AsyncClient) -> None:
    problem = assert_problem(await http.get("/healthz/"), 404, "not_found")
    assert problem["detail"] == "no endpoint at /healthz/; paths here have no trailing slash: /healthz"


def _operations(schema: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """Every (method, path, declared query parameters) of the OpenAPI document."""
    return [
        (method.upper(), path, [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"])
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
    ]


async def test_every_endpoint_refuses_unknown_query_parameters(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    """Driven by the OpenAPI document: each endpoint names the unknown parameter and exactly the ones
    it documents, and does nothing else (no lock taken, no token issued or revoked)."""
    schema = (await http.get("/openapi.json")).json()
    operations = _operations(schema)
    assert len(operations) >= 10
    bodies: dict[str, dict[str, Any]] = {
        "/v1/tokens": {"name": f"{resource}-t", "role": "agent"},
        "/v1/locks/{resource}/acquire": {"owner": "bot1"},
        "/v1/locks/{resource}/renew": {"owner": "bot1", "fencing_token": 1},
        "/v1/locks/{resource}/release": {"owner": "bot1", "fencing_token": 1},
        "/v1/locks/{resource}/force-release": {"reason": "r"},
        "/v1/reservations": {"owner": "bot1", "resources": [resource]},
        "/v1/reservations/{reservation_id}/renew": {
            "owner": "bot1",
            "leases": [{"resource": resource, "fencing_token": 1}],
        },
        "/v1/reservations/{reservation_id}/release": {
            "owner": "bot1",
            "leases": [{"resource": resource, "fencing_token": 1}],
        },
        "/v1/locks/{resource}/handoff": {"owner": "bot1", "fencing_token": 1, "to": "bot2"},
        "/v1/locks/{resource}/accept": {"owner": "bot2"},
        "/v1/locks/{resource}/decline": {"owner": "bot2"},
        "/v1/shared-locks/{resource}/acquire": {"owner": "bot1"},
        "/v1/shared-locks/{resource}/renew": {"owner": "bot1", "fencing_token": 1},
        "/v1/shared-locks/{resource}/release": {"owner": "bot1", "fencing_token": 1},
        "/v1/sagas": {"name": "n", "steps": [{"name": "a", "locks": []}]},
        "/v1/sagas/{saga_id}/steps/{step}/fail": {"reason": "r"},
        "/v1/sagas/{saga_id}/steps/{step}/compensation/fail": {"reason": "r"},
        "/v1/sagas/{saga_id}/abort": {"reason": "r"},
    }
    for method, template, declared in operations:
        # Valid otherwise: a command reports every invalid part at once, so only the query may be wrong.
        path = (
            template.replace("{resource}", resource)
            .replace("{name}", f"{resource}-t")
            .replace("{owner}", "bot1")
            .replace("{saga_id}", f"{resource}-saga")
            .replace("{step}", "a")
            .replace("{reservation_id}", f"{resource}-r")
        )
        body = bodies.get(template) if method == "POST" else None
        # A misspelt filter, as a user would send it; no endpoint has a parameter of that name.
        response = await http.request(method, path, params={"ownr": "x"}, json=body)
        problem = assert_problem(response, 422, "validation_error")
        accepted = ", ".join(declared) if declared else "none"
        assert problem["errors"] == [
            {
                "loc": ["query", "ownr"],
                "msg": f"Unknown query parameter; this endpoint accepts: {accepted}",
                "type": "extra_forbidden",
            }
        ], (method, template)
    # A misspelt filter no longer lists every lock.
    problem = assert_problem(await http.get("/v1/locks", params={"owner": "x"}), 422, "validation_error")
    assert problem["detail"] == (
        "query.owner: Unknown query parameter; this endpoint accepts: holder, prefix, expiring_within_ms,"
        " cursor, limit"
    )
    assert await event_types(admin_pool, resource) == []
    tokens = (await http.get("/v1/tokens", params={"include_revoked": "true"})).json()["items"]
    assert [t for t in tokens if t["name"] == f"{resource}-t"] == []


async def test_unknown_query_parameters_are_refused_beside_known_ones(http: httpx.AsyncClient) -> None:
    response = await http.get("/v1/locks", params={"holder": "bot1", "limit": 5, "colour": "red", "size": 1})
    problem = assert_problem(response, 422, "validation_error")
    assert [e["loc"] for e in problem["errors"]] == [["query", "colour"], ["query", "size"]]
    assert (await http.get("/metrics", params={"name[]": "x"})).status_code == 422


@pytest.mark.parametrize("command", ["acquire", "renew", "release", "force-release"])
async def test_wrong_method_is_405(http: httpx.AsyncClient, resource: str, command: str) -> None:
    for method in ("GET", "PUT", "DELETE"):
        response = await http.request(method, f"/v1/locks/{resource}/{command}")
        assert_problem(response, 405, "method_not_allowed")
        assert "POST" in response.headers["allow"]


# --- queries -----------------------------------------------------------------------------------------


async def _list(http: httpx.AsyncClient, **params: Any) -> dict[str, Any]:
    response = await http.get("/v1/locks", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_list_locks_filters_and_pages(http: httpx.AsyncClient, unique_prefix: str) -> None:
    count = 25
    resources = [f"{unique_prefix}pallet:{i:02d}" for i in range(count)]
    holder_a, holder_b = f"{unique_prefix}agv-a", f"{unique_prefix}agv-b"

    def owner_of(i: int) -> str:
        return holder_a if i % 2 == 0 else holder_b

    def ttl_of(i: int) -> int:
        return 20_000 if i % 5 == 0 else 600_000

    leases = await asyncio.gather(
        *(acquire(http, r, owner_of(i), ttl_of(i)) for i, r in enumerate(resources))
    )
    by_resource = {lease["resource"]: lease for lease in leases}

    # Cursor pagination: 3 pages of 10, 10 and 5 cover the 25 exactly once, in resource order.
    pages: list[list[dict[str, Any]]] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"prefix": unique_prefix, "limit": 10}
        if cursor is not None:
            params["cursor"] = cursor
        page = await _list(http, **params)
        pages.append(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
        assert cursor == page["items"][-1]["resource"]
        assert len(pages) < 10, "pagination does not end"
    assert [len(p) for p in pages] == [10, 10, 5]
    seen = [item["resource"] for p in pages for item in p]
    assert seen == sorted(resources)
    for item in (item for p in pages for item in p):
        lease = by_resource[item["resource"]]
        assert item["status"] == "held"
        assert item["owner"] == lease["owner"]
        assert item["fencing_token"] == lease["fencing_token"]
        assert item["ttl_ms"] == lease["ttl_ms"]
        assert ts(item["expires_at"]) == ts(lease["expires_at"])

    # A page exactly as long as what is left ends the listing.
    assert (await _list(http, prefix=unique_prefix, limit=count))["next_cursor"] is None
    assert (await _list(http, prefix=unique_prefix, limit=count - 1))["next_cursor"] is not None

    # holder
    held_by_a = await _list(http, holder=holder_a)
    assert [i["resource"] for i in held_by_a["items"]] == [r for i, r in enumerate(resources) if i % 2 == 0]
    assert {i["owner"] for i in held_by_a["items"]} == {holder_a}
    # holder and prefix together
    sub_prefix = f"{unique_prefix}pallet:1"
    both = await _list(http, holder=holder_b, prefix=sub_prefix)
    assert [i["resource"] for i in both["items"]] == [
        r for i, r in enumerate(resources) if i % 2 == 1 and r.startswith(sub_prefix)
    ]
    # expiring_within_ms: the 20 s leases are due within a minute, the 10 min leases are not.
    soon = await _list(http, prefix=unique_prefix, expiring_within_ms=60_000)
    assert [i["resource"] for i in soon["items"]] == [r for i, r in enumerate(resources) if i % 5 == 0]
    assert (await _list(http, prefix=unique_prefix, expiring_within_ms=0))["items"] == []
    # A prefix is a prefix, not a pattern: LIKE wildcards match nothing here.
    assert (await _list(http, prefix=f"{unique_prefix}pallet_"))["items"] == []
    assert (await _list(http, prefix="zz-no-such-prefix-"))["items"] == []

    # Only live leases are listed: a released lock drops out.
    first = by_resource[resources[0]]
    released = await http.post(
        f"/v1/locks/{resources[0]}/release", json={"owner": holder_a, "fencing_token": first["fencing_token"]}
    )
    assert released.status_code == 200
    remaining = await _list(http, prefix=unique_prefix, limit=100)
    assert [i["resource"] for i in remaining["items"]] == sorted(resources[1:])


async def test_get_lock_fields_and_status(http: httpx.AsyncClient, resource: str) -> None:
    lease = await acquire(http, resource, "bot1", ttl_ms=20_000)
    held = (await http.get(f"/v1/locks/{resource}")).json()
    assert held["resource"] == resource
    assert held["status"] == "held"
    assert held["owner"] == "bot1"
    assert held["fencing_token"] == lease["fencing_token"] == 1
    assert held["ttl_ms"] == 20_000
    assert held["version"] == 1
    assert held["ended_by"] is None
    assert ts(held["expires_at"]) == ts(lease["expires_at"])
    acquired_at = ts(held["acquired_at"])
    assert ts(held["updated_at"]) == acquired_at
    assert (ts(held["expires_at"]) - acquired_at).total_seconds() == pytest.approx(20.0, abs=0.001)

    released = await http.post(f"/v1/locks/{resource}/release", json={"owner": "bot1", "fencing_token": 1})
    assert released.status_code == 200
    free = (await http.get(f"/v1/locks/{resource}")).json()
    assert free["status"] == "free"
    assert free["ended_by"] == "LOCK_RELEASED"
    assert free["version"] == 2
    assert free["fencing_token"] == 1
    assert ts(free["updated_at"]) >= acquired_at
    assert ts(free["acquired_at"]) == acquired_at


async def test_history_pages_with_after_version(http: httpx.AsyncClient, resource: str) -> None:
    lease = await acquire(http, resource, "bot1")
    body = {"owner": "bot1", "fencing_token": lease["fencing_token"]}
    for i in range(4):
        renewed = await http.post(
            f"/v1/locks/{resource}/renew", json=body, headers={"Idempotency-Key": f"{resource}-renew-{i}"}
        )
        assert renewed.status_code == 200
    assert (await http.post(f"/v1/locks/{resource}/release", json=body)).status_code == 200
    expected = ["LOCK_ACQUIRED"] + ["LOCK_RENEWED"] * 4 + ["LOCK_RELEASED"]

    everything = (await http.get(f"/v1/locks/{resource}/history")).json()
    assert everything["resource"] == resource
    assert [e["type"] for e in everything["events"]] == expected
    assert everything["next_after_version"] is None

    events: list[dict[str, Any]] = []
    after: int | None = 0
    pages = 0
    while after is not None:
        page = (
            await http.get(f"/v1/locks/{resource}/history", params={"after_version": after, "limit": 4})
        ).json()
        events.extend(page["events"])
        after = page["next_after_version"]
        pages += 1
        assert pages <= 5
    assert pages == 2
    assert events == everything["events"]
    assert [e["version"] for e in events] == list(range(1, 7))
    positions = [e["position"] for e in events]
    assert positions == sorted(positions)
    assert len(set(positions)) == 6
    recorded = [ts(e["recorded_at"]) for e in events]
    assert recorded == sorted(recorded)
    assert all(e["data"]["fencing_token"] == lease["fencing_token"] for e in events)
    assert all(e["data"]["owner"] == "bot1" for e in events)
    assert [e["metadata"]["command"] for e in events] == ["acquire"] + ["renew"] * 4 + ["release"]
    assert [e["metadata"].get("idempotency_key") for e in events[1:5]] == [
        f"{resource}-renew-{i}" for i in range(4)
    ]
    assert len({e["event_id"] for e in events}) == 6

    tail = (await http.get(f"/v1/locks/{resource}/history", params={"after_version": 5})).json()
    assert [e["version"] for e in tail["events"]] == [6]
    assert (await http.get(f"/v1/locks/{resource}/history", params={"after_version": 6})).json()[
        "events"
    ] == []


# --- health and OpenAPI ------------------------------------------------------------------------------


async def test_health_endpoints(http: httpx.AsyncClient) -> None:
    healthz = await http.get("/healthz")
    assert healthz.status_code == 200
    assert healthz.json() == {"status": "ok"}
    readyz = await http.get("/readyz")
    assert readyz.status_code == 200
    body = readyz.json()
    assert body["status"] == "ready"
    assert set(body["projectors"]) == {"holding_periods", "agent_stats"}  # detail: each projector's lag


async def test_metrics_show_database_batches_and_event_loop_lag(
    http: httpx.AsyncClient, resource: str
) -> None:
    """Where a command's time goes, for operators: commands per round trip, the round trip, the loop's
    lateness (docs/performance.md reads them the same way)."""

    async def samples() -> dict[tuple[str, str], float]:
        text = (await http.get("/metrics")).text
        return {
            (sample.name, sample.labels.get("kind", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    before = await samples()
    await acquire(http, resource, "bot1")
    await asyncio.sleep(0.25)  # the lag watcher wakes every 100 ms
    after = await samples()
    commit_count = ("lockledger_db_batch_size_count", "commit")
    assert after[commit_count] - before.get(commit_count, 0) >= 1
    commit_sum = ("lockledger_db_batch_size_sum", "commit")
    assert after[commit_sum] - before.get(commit_sum, 0) >= 1
    assert after[("lockledger_db_batch_seconds_count", "commit")] == after[commit_count]
    assert after[("lockledger_db_batch_seconds_sum", "commit")] > 0
    lag_count = ("lockledger_event_loop_lag_seconds_count", "")
    assert after[lag_count] - before.get(lag_count, 0) >= 1


async def test_leases_held_gauge_counts_live_leases_database_wide(
    http: httpx.AsyncClient, unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    count_sql = "SELECT count(*) FROM lock_state WHERE status = 'held' AND expires_at > clock_timestamp()"

    async def scraped() -> float:
        text = (await http.get("/metrics")).text
        [family] = [f for f in text_string_to_metric_families(text) if f.name == "lockledger_leases_held"]
        assert family.type == "gauge"
        assert "Database-wide" in family.documentation
        [sample] = family.samples
        return float(sample.value)

    async def bracketed() -> float:
        """The gauge, checked against the table's own count just before and after the scrape (other
        tests' leases may lapse meanwhile, so the count can only fall between the two)."""
        before = await admin_pool.fetchval(count_sql)
        value = await scraped()
        after = await admin_pool.fetchval(count_sql)
        assert after <= value <= before
        return value

    leases = [await acquire(http, f"{unique_prefix}{i}", "bot1", ttl_ms=600_000) for i in range(3)]
    assert await bracketed() >= 3
    # A released lease and a lapsed one (its LOCK_EXPIRED perhaps not appended yet) are not counted.
    await acquire(http, f"{unique_prefix}short", "bot1", ttl_ms=1_000)
    first = leases[0]
    released = await http.post(
        f"/v1/locks/{first['resource']}/release",
        json={"owner": "bot1", "fencing_token": first["fencing_token"]},
    )
    assert released.status_code == 200
    await asyncio.sleep(1.1)
    live = await admin_pool.fetchval(
        "SELECT count(*) FROM lock_state WHERE resource LIKE $1 AND status = 'held'"
        " AND expires_at > clock_timestamp()",
        f"{unique_prefix}%",
    )
    assert live == 2
    await bracketed()


async def test_docs_pages_load_their_assets_from_this_server(http: httpx.AsyncClient) -> None:
    """/docs and /redoc work on a closed network: every script, stylesheet and icon they load is a path
    of this server, and each answers with its content."""
    from html.parser import HTMLParser

    class Assets(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.found: list[tuple[str, str]] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            for name, value in attrs:
                if name in ("src", "href") and value is not None:
                    self.found.append((tag, value))

    expected_types = {"script": ("text/javascript", "application/javascript"), "link": ("text/css", "image/")}
    for page in ("/docs", "/redoc"):
        response = await http.get(page)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert "https://" not in response.text
        assert "http://" not in response.text
        parser = Assets()
        parser.feed(response.text)
        scripts = [url for tag, url in parser.found if tag == "script"]
        assert scripts, page
        for tag, url in parser.found:
            assert url.startswith("/"), (page, url)
            assert not url.startswith("//"), (page, url)
            asset = await http.get(url)
            assert asset.status_code == 200, (page, url)
            assert asset.headers["content-type"].startswith(expected_types[tag]), (page, url)
            assert len(asset.content) > 1000, (page, url)
    refused = await http.post("/docs/static/swagger-ui.css")
    assert_problem(refused, 405, "method_not_allowed")
    assert refused.headers["allow"] == "GET, HEAD"


async def test_openapi_lists_every_path(http: httpx.AsyncClient) -> None:
    response = await http.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    paths: dict[str, dict[str, Any]] = schema["paths"]
    expected_methods = {
        "/v1/locks/{resource}/acquire": "post",
        "/v1/locks/{resource}/renew": "post",
        "/v1/locks/{resource}/release": "post",
        "/v1/locks/{resource}/force-release": "post",
        "/v1/locks": "get",
        "/v1/locks/{resource}": "get",
        "/v1/locks/{resource}/history": "get",
        "/healthz": "get",
        "/readyz": "get",
    }
    assert set(expected_methods) <= set(paths)
    for path, method in expected_methods.items():
        assert method in paths[path], (path, sorted(paths[path]))
    # Every command documents its problem responses and the Idempotency-Key header.
    for command in ("acquire", "renew", "release", "force-release"):
        operation = paths[f"/v1/locks/{{resource}}/{command}"]["post"]
        assert "422" in operation["responses"]
        headers = [p["name"] for p in operation.get("parameters", []) if p["in"] == "header"]
        assert "Idempotency-Key" in headers
    assert "409" in paths["/v1/locks/{resource}/acquire"]["post"]["responses"]
    assert "410" in paths["/v1/locks/{resource}/renew"]["post"]["responses"]


# --- force-release -----------------------------------------------------------------------------------

NOTHING_RELEASED = {"released": False, "owner": None, "fencing_token": None, "event": None, "reason": None}


async def test_force_release(http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool) -> None:
    lease = await acquire(http, resource, "bot1")
    token = lease["fencing_token"]
    reason = "agv bot1 stuck in aisle 7"

    forced = await http.post(f"/v1/locks/{resource}/force-release", json={"reason": reason})
    assert forced.status_code == 200, forced.text
    assert forced.json() == {
        "resource": resource,
        "released": True,
        "owner": "bot1",
        "fencing_token": token,
        "event": "LOCK_FORCE_RELEASED",
        "reason": reason,
    }
    row = await admin_pool.fetchrow(
        "SELECT event_type, data::text AS data FROM events"
        " WHERE stream_id = $1 ORDER BY stream_version DESC LIMIT 1",
        resource,
    )
    assert row is not None
    assert row["event_type"] == "LOCK_FORCE_RELEASED"
    data = json.loads(row["data"])
    assert data["reason"] == reason
    assert data["owner"] == "bot1"
    assert data["fencing_token"] == token

    view = (await http.get(f"/v1/locks/{resource}")).json()
    assert view["status"] == "free"
    assert view["ended_by"] == "LOCK_FORCE_RELEASED"

    # The old holder has lost the lease for good.
    old = {"owner": "bot1", "fencing_token": token}
    assert_problem(await http.post(f"/v1/locks/{resource}/renew", json=old), 409, "not_holder")
    assert_problem(await http.post(f"/v1/locks/{resource}/release", json=old), 409, "not_holder")

    # A free lock is left as it is: nothing released, nothing recorded.
    again = await http.post(f"/v1/locks/{resource}/force-release", json={"reason": "again"})
    assert again.status_code == 200
    assert again.json() == NOTHING_RELEASED | {"resource": resource}
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED", "LOCK_FORCE_RELEASED"]

    # The next holder's token is larger than the one that was forced out.
    assert (await acquire(http, resource, "bot2"))["fencing_token"] > token


async def test_force_release_of_a_never_locked_resource(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    response = await http.post(f"/v1/locks/{resource}/force-release", json={"reason": "cleanup"})
    assert response.status_code == 200
    assert response.json() == NOTHING_RELEASED | {"resource": resource}
    assert await event_types(admin_pool, resource) == []
    assert_problem(await http.get(f"/v1/locks/{resource}"), 404, "not_found")


async def test_metrics_show_the_projectors_lag_and_what_they_applied(
    http: httpx.AsyncClient, resource: str
) -> None:
    def projector_samples(text: str) -> dict[str, float]:
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("projector") == "holding_periods"
        }

    before = projector_samples((await http.get("/metrics")).text)
    await acquire(http, resource, "bot1")
    for _ in range(600):  # a bound, not a timing: the runner polls every 100 ms, behind a busy log
        after = projector_samples((await http.get("/metrics")).text)
        if after.get("lockledger_projector_events_total", 0) > before.get(
            "lockledger_projector_events_total", 0
        ):
            break
        await asyncio.sleep(0.05)
    assert after["lockledger_projector_events_total"] > before.get("lockledger_projector_events_total", 0)
    assert after["lockledger_projector_delay_seconds_count"] >= 1
    assert 0 <= after["lockledger_projector_lag_seconds"] < 60
