"""Hostile input over real HTTP: every size and bounds limit answers a clear 4xx problem+json.

Bodies (with and without Content-Length), header sections, resource names,
TTLs and page sizes each have a limit, and going past it is a 4xx with a stable ``code``, never a 5xx or
a hang, and the server keeps serving afterwards.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest
import uvicorn

from api.app import create_app
from api.http_protocol import GuardedHttpToolsProtocol
from service.config import Settings
from tests.assertions import PROBLEM_JSON, assert_problem
from tests.servers import ServerProcess, free_port, running_server

pytestmark = pytest.mark.storage

MAX_BODY = 16_384  # service/config.py defaults, which the shared `server` runs with
MAX_HEADERS = 8_192


def field_named(problem: dict[str, Any], *loc: str) -> bool:
    """The validation problem points at the field, by ``errors[].loc``."""
    return any(tuple(e["loc"][: len(loc)]) == loc for e in problem.get("errors", []))


async def events(admin_pool: asyncpg.Pool, resource: str) -> int:
    count: int = await admin_pool.fetchval("SELECT count(*) FROM events WHERE stream_id = $1", resource)
    return count


async def chunks(total: int, size: int = 4_096) -> AsyncIterator[bytes]:
    """A body httpx sends chunked (no Content-Length), as a streaming client would."""
    sent = 0
    while sent < total:
        piece = min(size, total - sent)
        yield b" " * piece
        sent += piece


# --- body size ----------------------------------------------------------------------------------------


async def test_body_over_the_limit_with_content_length(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    body = b'{"owner": "bot1", "ttl_ms": 5000}' + b" " * MAX_BODY
    response = await http.post(
        f"/v1/locks/{resource}/acquire", content=body, headers={"content-type": "application/json"}
    )
    problem = assert_problem(response, 413, "payload_too_large")
    assert str(MAX_BODY) in problem["detail"]
    assert problem["instance"] == f"/v1/locks/{resource}/acquire"
    assert await events(admin_pool, resource) == 0
    # The connection and the server go on serving.
    assert (await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1"})).status_code == 201


async def test_body_over_the_limit_without_content_length(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    response = await http.post(
        f"/v1/locks/{resource}/acquire",
        content=chunks(MAX_BODY + 1),
        headers={"content-type": "application/json"},
    )
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert_problem(response, 413, "payload_too_large")
    assert await events(admin_pool, resource) == 0
    assert (await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1"})).status_code == 201


async def test_chunked_body_within_the_limit_is_served(http: httpx.AsyncClient, resource: str) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"owner": '
        yield b'"bot1"}'

    response = await http.post(
        f"/v1/locks/{resource}/acquire", content=body(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 201, response.text


async def test_largest_legitimate_body_fits(http: httpx.AsyncClient, resource: str) -> None:
    # The longest reason (1000 characters), each an astral code point that JSON escapes as 12 bytes.
    reason = "\U0001f916" * 1000
    response = await http.post(f"/v1/locks/{resource}/force-release", json={"reason": reason})
    assert len(response.request.content) < MAX_BODY
    assert response.status_code == 200, response.text


# --- header size --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "limit"),
    [
        ({"X-Padding": "a" * MAX_HEADERS}, MAX_HEADERS),
        ({f"X-Padding-{i}": "a" * 100 for i in range(100)}, MAX_HEADERS),
        # Past 64 KiB the server's HTTP protocol refuses the head before it is complete (memory guard).
        ({"X-Padding": "a" * 1_000_000}, 65_536),
    ],
    ids=["one-9k-header", "many-headers", "one-1MB-header"],
)
async def test_headers_over_the_limit(http: httpx.AsyncClient, headers: dict[str, str], limit: int) -> None:
    for response in (
        await http.get("/healthz", headers=headers),
        await http.get("/v1/locks", headers=headers),
    ):
        problem = assert_problem(response, 431, "headers_too_large")
        assert str(limit) in problem["detail"]
    assert (await http.get("/healthz")).status_code == 200


async def test_headers_within_the_limit_are_served(http: httpx.AsyncClient) -> None:
    response = await http.get("/healthz", headers={"X-Padding": "a" * (MAX_HEADERS - 500)})
    assert response.status_code == 200


def test_unfinished_header_section_does_not_stop_other_requests(server: ServerProcess) -> None:
    """A client that never ends its headers holds only its own connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as stalled:
        stalled.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 50_000)
        assert httpx.get(f"{server.base_url}/healthz", timeout=5).status_code == 200


# --- resource names, TTLs, page sizes ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a" * 201,
        "bad%20name",
        "star*",
        "caf%C3%A9",
        "nul%00",
        "quote%22",
        "tab%09",
        "at@sign",
        "comma,",
        "...",
        "%2E%2E%2E",
    ],
)
@pytest.mark.parametrize("request_line", ["POST acquire", "GET lock", "GET history"])
async def test_bad_resource_name_names_the_field(
    http: httpx.AsyncClient, name: str, request_line: str
) -> None:
    method, what = request_line.split()
    path = {
        "acquire": f"/v1/locks/{name}/acquire",
        "lock": f"/v1/locks/{name}",
        "history": f"/v1/locks/{name}/history",
    }[what]
    response = await http.request(method, path, json={"owner": "bot1"} if method == "POST" else None)
    problem = assert_problem(response, 422, "validation_error")
    assert field_named(problem, "path", "resource"), problem


async def test_empty_resource_is_not_found(http: httpx.AsyncClient) -> None:
    # An empty segment matches no route at all (the resource is missing, not malformed): 404, not 500.
    response = await http.post("/v1/locks//acquire", json={"owner": "bot1"})
    assert_problem(response, 404, "not_found")


@pytest.mark.parametrize("ttl_ms", [999, 0, -1, 3_600_001, 2**70])
async def test_ttl_out_of_bounds_names_the_field(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, ttl_ms: int
) -> None:
    response = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": ttl_ms})
    problem = assert_problem(response, 422, "validation_error")
    assert "ttl_ms" in problem["detail"]
    assert await events(admin_pool, resource) == 0


@pytest.mark.parametrize("ttl_ms", ["1500", 1500.5, True, [1500], {"ms": 1500}])
@pytest.mark.parametrize("command", ["acquire", "renew"])
async def test_non_integer_ttl_names_the_field(
    http: httpx.AsyncClient, resource: str, ttl_ms: object, command: str
) -> None:
    body: dict[str, object] = {"owner": "bot1", "ttl_ms": ttl_ms}
    if command == "renew":
        body["fencing_token"] = 1
    problem = assert_problem(
        await http.post(f"/v1/locks/{resource}/{command}", json=body), 422, "validation_error"
    )
    assert field_named(problem, "body", "ttl_ms"), problem


@pytest.mark.parametrize("limit", ["0", "1001", "-1", "abc", "1.5", "99999999999999999999"])
@pytest.mark.parametrize("path", ["/v1/locks", "/v1/locks/zone:A3/history"])
async def test_page_size_out_of_bounds_names_the_field(
    http: httpx.AsyncClient, path: str, limit: str
) -> None:
    problem = assert_problem(await http.get(path, params={"limit": limit}), 422, "validation_error")
    assert field_named(problem, "query", "limit"), problem


@pytest.mark.parametrize("limit", ["1", "1000"])
async def test_page_size_bounds_are_inclusive(http: httpx.AsyncClient, limit: str) -> None:
    assert (await http.get("/v1/locks", params={"limit": limit})).status_code == 200


# --- the limits are settings --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_limits_server(database_url: str) -> Iterator[ServerProcess]:
    overrides = {
        "LOCKLEDGER_MAX_BODY_BYTES": "64",
        "LOCKLEDGER_MAX_HEADER_BYTES": "1024",
        "LOCKLEDGER_REAPER_ENABLED": "false",
    }
    with running_server(database_url, overrides) as proc:
        yield proc


@pytest.fixture
async def small(small_limits_server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=small_limits_server.base_url, timeout=30.0) as client:
        yield client


async def test_limits_come_from_settings(small: httpx.AsyncClient, resource: str) -> None:
    assert (await small.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1"})).status_code == 201
    too_big = await small.post(f"/v1/locks/{resource}/force-release", json={"reason": "r" * 64})
    assert "64 bytes" in assert_problem(too_big, 413, "payload_too_large")["detail"]
    streamed = await small.post(
        f"/v1/locks/{resource}/force-release",
        content=chunks(65, size=16),
        headers={"content-type": "application/json"},
    )
    assert_problem(streamed, 413, "payload_too_large")
    headers = {"X-Padding": "a" * 1024}
    assert (
        "1024"
        in assert_problem(await small.get("/healthz", headers=headers), 431, "headers_too_large")["detail"]
    )
    assert (await small.get("/healthz")).status_code == 200


async def test_integral_json_number_is_an_integer(http: httpx.AsyncClient, resource: str) -> None:
    # JSON has one number type: 1500.0 is 1500 (as JSON Schema's "integer" agrees); "1500" is not.
    acquired = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": 1500.0})
    assert acquired.status_code == 201, acquired.text
    lease = acquired.json()
    assert lease["ttl_ms"] == 1500
    release = {"owner": "bot1", "fencing_token": float(lease["fencing_token"])}
    assert (await http.post(f"/v1/locks/{resource}/release", json=release)).status_code == 200


# --- the OpenAPI says all of this --------------------------------------------------------------------


async def test_openapi_documents_the_limits(http: httpx.AsyncClient) -> None:
    document = (await http.get("/openapi.json")).json()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "431" in responses, (method, path)
            assert ("413" in responses) == ("requestBody" in operation), (method, path)
            for status in ("413", "431"):
                if status in responses:
                    assert PROBLEM_JSON in responses[status]["content"]
    bodies = document["components"]["schemas"]
    for name in ("AcquireRequest", "RenewRequest"):
        integer = next(b for b in bodies[name]["properties"]["ttl_ms"]["anyOf"] if b.get("type") == "integer")
        assert (integer["minimum"], integer["maximum"]) == (1_000, 3_600_000)
    # Exact integers, not 4.611686018427388e+18 (which reads back as a number above the bound).
    assert bodies["RenewRequest"]["properties"]["fencing_token"]["maximum"] == 2**62
    raw = (await http.get("/openapi.json")).text
    assert "e+18" not in raw


# --- the protocol-level cap on an unfinished head --------------------------------------------------


@pytest.fixture(scope="module")
def capped_port(database_url: str) -> Iterator[int]:
    """The app under uvicorn with ``GuardedHttpToolsProtocol`` (a 64 KiB cap), in a thread."""
    settings = Settings(database_url=database_url, dev_mode=True, reaper_enabled=False)
    config = uvicorn.Config(
        create_app(settings), port=free_port(), http=GuardedHttpToolsProtocol, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield config.port
    finally:
        server.should_exit = True
        thread.join(10)


def test_endless_header_is_cut_off_unread(capped_port: int) -> None:
    with socket.create_connection(("127.0.0.1", capped_port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: ")
        sent = 0
        while sent < 10_000_000 and not select.select([sock], [], [], 0.01)[0]:
            try:
                sock.sendall(b"a" * 16_384)
            except OSError:  # closed by the server
                break
            sent += 16_384
        answer = sock.recv(4_096)
    assert answer.startswith(b"HTTP/1.1 431 "), answer
    assert b"application/problem+json" in answer
    assert b'"code": "headers_too_large"' in answer
    assert sent <= 256 * 1024
    assert httpx.get(f"http://127.0.0.1:{capped_port}/healthz", timeout=5).status_code == 200


def test_capped_protocol_keeps_exact_limits_and_pipelining(capped_port: int) -> None:
    base = f"http://127.0.0.1:{capped_port}"
    over = httpx.get(f"{base}/healthz", headers={"X-Padding": "a" * MAX_HEADERS}, timeout=5)
    assert_problem(over, 431, "headers_too_large")  # the middleware's exact limit, below the cap
    # 200 pipelined requests of 6 KiB heads, 1.2 MB in one burst: the reads end mid-head again and again,
    # and none of it is a head over the cap.
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 6_000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", capped_port), timeout=10) as sock:
        sock.sendall(request * 200)
        received = b""
        while received.count(b"HTTP/1.1 200 ") < 200:
            chunk = sock.recv(65_536)
            assert chunk, received[-300:]
            received += chunk
    assert b" 431 " not in received


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/locks/zone:A3", "GET"),
        ("GET", "/v1/locks/zone:A3/acquire", "POST"),
        ("DELETE", "/v1/tokens", "GET, POST"),  # two routes share the path: both methods are named
    ],
)
async def test_unsupported_method_names_every_allowed_one(
    http: httpx.AsyncClient, method: str, path: str, allow: str
) -> None:
    response = await http.request(method, path)
    assert_problem(response, 405, "method_not_allowed")
    assert response.headers["allow"] == allow
