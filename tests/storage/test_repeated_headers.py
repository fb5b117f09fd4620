"""A header the service reads as one value, sent twice, is 400 ``bad_request`` naming it, on every path:
the command fast path, the router's endpoints, health and docs. Served as the first, it would let a proxy
or an audit that reads the last disagree with the service about the caller or the request.

Against a real server (``api/limits.py`` refuses them before routing), over raw sockets where an HTTP
client would not send what is tested (two Host or Content-Length lines).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.limits import SINGLE_VALUE_HEADERS
from domain.access import Role
from tests.api.routing import bench_app
from tests.assertions import assert_problem
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage

# Each single-value header with a value the endpoints below would take.
VALUES = {
    "Authorization": "Bearer llt_not-a-token",
    "Content-Type": "application/json",
    "Idempotency-Key": "key-1",
    "X-Correlation-ID": "corr-1",
    "X-Causation-ID": "cause-1",
    "X-Saga-ID": "saga-1",
    "X-Saga-Step": "step-1",
    "Last-Event-ID": "0",
}
# One path of each kind: the command fast path, the router's queries, replay and feed, health and docs.
GETS = [
    "/v1/locks",
    "/v1/replay/state?at=2026-01-01T00:00:00Z",
    "/v1/events/stream",
    "/healthz",
    "/openapi.json",
]


def repeated(problem: dict[str, Any], header: str) -> None:
    assert problem["header"] == header
    assert f"more than one {header} header" in problem["detail"]


async def events(admin_pool: asyncpg.Pool, resource: str) -> int:
    count: int = await admin_pool.fetchval("SELECT count(*) FROM events WHERE stream_id = $1", resource)
    return count


def test_every_header_the_service_reads_is_single_valued() -> None:
    assert set(SINGLE_VALUE_HEADERS.values()) == {*VALUES, "Host", "Content-Length"}


@pytest.mark.parametrize("header", sorted(VALUES))
async def test_a_repeated_header_on_the_command_fast_path_is_400_and_appends_nothing(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, resource: str, header: str
) -> None:
    value = VALUES[header]
    headers = [("Content-Type", "application/json"), (header, value), (header, value)]
    if header == "Content-Type":
        headers = headers[1:]
    body = json.dumps({"owner": "agv-1", "ttl_ms": 5_000})
    answer = await http.post(f"/v1/locks/{resource}/acquire", content=body, headers=headers)
    repeated(assert_problem(answer, 400, "bad_request"), header)
    assert answer.json()["instance"] == f"/v1/locks/{resource}/acquire"
    assert await events(admin_pool, resource) == 0
    # Sent once, the same request is served (dev mode: the Authorization header is not looked at).
    once = list(dict.fromkeys(headers))
    served = await http.post(f"/v1/locks/{resource}/acquire", content=body, headers=once)
    assert served.status_code == 201, served.text


@pytest.mark.parametrize("path", GETS)
@pytest.mark.parametrize("header", ["Authorization", "Last-Event-ID", "Idempotency-Key", "X-Correlation-ID"])
async def test_a_repeated_header_on_the_routers_paths_is_400(
    http: httpx.AsyncClient, path: str, header: str
) -> None:
    # Different values and letter case: HTTP field names are case-insensitive.
    headers = [(header, VALUES[header]), (header.upper(), VALUES[header] + "2")]
    answer = await http.get(path, headers=headers)
    repeated(assert_problem(answer, 400, "bad_request"), header)


async def test_list_headers_may_repeat(http: httpx.AsyncClient) -> None:
    headers = [("Accept", "application/json"), ("Accept", "*/*"), ("X-Other", "a"), ("X-Other", "b")]
    assert (await http.get("/v1/locks", headers=headers)).status_code == 200


async def test_two_authorization_headers_are_refused_whichever_is_valid(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    token = await issue_token(f"{unique_prefix}agent", Role.AGENT)
    valid, other = f"Bearer {token}", "Bearer llt_someone-else"
    async with httpx.AsyncClient(base_url=auth_server.base_url) as client:
        path = f"/v1/locks/{unique_prefix}zone/acquire"
        for pair in ((valid, other), (other, valid), (valid, valid)):
            headers = [("Authorization", pair[0]), ("Authorization", pair[1])]
            answer = await client.post(path, json={"ttl_ms": 5_000}, headers=headers)
            repeated(assert_problem(answer, 400, "bad_request"), "Authorization")
            answer = await client.get("/v1/replay/state?at=2026-01-01T00:00:00Z", headers=headers)
            repeated(assert_problem(answer, 400, "bad_request"), "Authorization")
        served = await client.post(path, json={"ttl_ms": 5_000}, headers={"Authorization": valid})
        assert served.status_code == 201, served.text


async def _raw(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = await asyncio.wait_for(reader.readexactly(length), 10)
        return status, json.loads(body)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "path", ["/v1/locks/{prefix}zone/acquire", "/v1/locks/{prefix}zone/nothing-here", "/healthz"]
)
async def test_two_host_lines_are_400(server: ServerProcess, unique_prefix: str, path: str) -> None:
    body = b'{"owner": "agv-1", "ttl_ms": 5000}'
    request = (
        f"POST {path.format(prefix=unique_prefix)} HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    status, problem = await _raw(server.port, request)
    assert (status, problem["code"], problem["header"]) == (400, "bad_request", "Host")


async def test_two_content_lengths_are_400(server: ServerProcess, unique_prefix: str) -> None:
    """The HTTP parser already refuses two Content-Length lines; the layer would too."""
    body = b'{"owner": "agv-1", "ttl_ms": 5000}'
    request = (
        f"POST /v1/locks/{unique_prefix}zone/acquire HTTP/1.1\r\nHost: a\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    status, problem = await _raw(server.port, request)
    assert (status, problem["code"]) == (400, "bad_request")


_NAMES = st.sampled_from(sorted(VALUES))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    once=st.lists(_NAMES, unique=True, max_size=4),
    twice=st.lists(_NAMES, min_size=1, unique=True, max_size=3),
    data=st.data(),
)
async def test_any_repeated_single_value_header_names_one_that_was_repeated(
    http: httpx.AsyncClient, once: list[str], twice: list[str], data: st.DataObject
) -> None:
    single = [(name, VALUES[name]) for name in once if name not in twice]
    headers = data.draw(st.permutations(single + [(name, VALUES[name]) for name in twice] * 2))
    post = data.draw(st.booleans())
    if post:
        answer = await http.post("/v1/locks/zone:hyp/acquire", content=b"{}", headers=headers)
    else:
        answer = await http.get("/v1/locks", headers=headers)
    problem = assert_problem(answer, 400, "bad_request")
    names = [name for name, _ in headers]
    assert names.count(problem["header"]) >= 2


async def test_openapi_documents_the_400_and_every_header_read_is_single_valued(
    http: httpx.AsyncClient,
) -> None:
    document = (await http.get("/openapi.json")).json()
    single = {name.lower() for name in SINGLE_VALUE_HEADERS.values()}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "application/problem+json" in operation["responses"]["400"]["content"], (method, path)
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "header":
                    assert parameter["name"].lower() in single, (method, path, parameter["name"])


@pytest.mark.parametrize("opentelemetry", [False, True])
async def test_the_layer_answers_before_the_fast_path_and_the_router(opentelemetry: bool) -> None:
    """With OpenTelemetry on, commands are served by the router instead of the fast path; the layer is
    outside both, so it answers either way, before the app is even started (no database is needed)."""
    app = bench_app(opentelemetry=opentelemetry)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://lockledger") as client:
        for path in ("/v1/locks/zone:A3/acquire", "/v1/noop/zone:A3/acquire", "/v1/locks"):
            headers = [("Idempotency-Key", "a"), ("idempotency-key", "b")]
            answer = await client.request("POST" if "acquire" in path else "GET", path, headers=headers)
            repeated(assert_problem(answer, 400, "bad_request"), "Idempotency-Key")
