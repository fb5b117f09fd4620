"""Idempotency-Key over real HTTP (DESIGN.md, "Idempotency").

Same key + same request: the stored response again, byte for byte, with ``Idempotent-Replayed: true``,
and no new event. Same key + another request: 422 ``idempotency_key_reused``. Outcomes that appended events
are always recorded, in the same transaction as the events. Rejections are *not* recorded: a retry of a
rejected command is decided again (documented here by test_rejection_is_reevaluated_on_retry).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from typing import Any

import asyncpg
import httpx
import pytest

from tests.assertions import assert_problem

pytestmark = pytest.mark.storage

PRINCIPAL = "anonymous"  # every caller, until authentication lands


def new_key() -> str:
    # Keys are scoped to the principal, not the resource: make them unique across the whole run.
    return f"key-{uuid.uuid4().hex}"


async def event_types(admin_pool: asyncpg.Pool, resource: str) -> list[str]:
    rows = await admin_pool.fetch(
        "SELECT event_type FROM events WHERE stream_id = $1 ORDER BY stream_version", resource
    )
    return [row["event_type"] for row in rows]


async def stored_key(admin_pool: asyncpg.Pool, key: str) -> asyncpg.Record | None:
    return await admin_pool.fetchrow(
        "SELECT resource, response::text AS response FROM idempotency_keys WHERE principal = $1 AND key = $2",
        PRINCIPAL,
        key,
    )


async def keyed_metadata(admin_pool: asyncpg.Pool, resource: str, key: str) -> list[dict[str, Any]]:
    rows = await admin_pool.fetch(
        "SELECT metadata::text AS metadata FROM events"
        " WHERE stream_id = $1 AND metadata->>'idempotency_key' = $2",
        resource,
        key,
    )
    return [json.loads(row["metadata"]) for row in rows]


async def test_sequential_retry_replays_the_stored_response(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    key = new_key()
    url = f"/v1/locks/{resource}/acquire"
    body = {"owner": "bot1", "ttl_ms": 20_000}

    first = await http.post(url, json=body, headers={"Idempotency-Key": key})
    assert first.status_code == 201, first.text
    assert "Idempotent-Replayed" not in first.headers
    lease = first.json()
    assert lease["owner"] == "bot1"
    assert lease["fencing_token"] == 1
    assert lease["ttl_ms"] == 20_000

    second = await http.post(url, json=body, headers={"Idempotency-Key": key})
    assert second.status_code == 201
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["content-type"] == "application/json"
    assert second.content == first.content

    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]
    # The key, its request and its response live in the same database as the event they describe.
    row = await stored_key(admin_pool, key)
    assert row is not None
    assert row["resource"] == resource
    assert json.loads(row["response"]) == lease
    assert json.loads(row["response"]) == first.json()
    (metadata,) = await keyed_metadata(admin_pool, resource, key)
    assert metadata["command"] == "acquire"

    # The replay is of the stored response, not a new decision: without the key the same request
    # is a fresh acquire and is refused (locks are not re-entrant).
    unkeyed = await http.post(url, json=body)
    assert_problem(unkeyed, 409, "lock_held")


@pytest.mark.parametrize("stream", ["new-stream", "existing-stream"])
async def test_concurrent_identical_requests_take_the_lock_once(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, stream: str
) -> None:
    before: list[str] = []
    if stream == "existing-stream":
        # The race is then decided on the stream head's row lock instead of on inserting the head.
        taken = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot0"})
        assert taken.status_code == 201
        token = taken.json()["fencing_token"]
        released = await http.post(
            f"/v1/locks/{resource}/release", json={"owner": "bot0", "fencing_token": token}
        )
        assert released.status_code == 200
        before = ["LOCK_ACQUIRED", "LOCK_RELEASED"]

    key = new_key()
    responses = await asyncio.gather(
        *(
            http.post(
                f"/v1/locks/{resource}/acquire",
                json={"owner": "bot1", "ttl_ms": 20_000},
                headers={"Idempotency-Key": key},
            )
            for _ in range(20)
        )
    )
    assert Counter(r.status_code for r in responses) == {201: 20}, [r.text for r in responses]
    assert len({r.content for r in responses}) == 1
    # Exactly one of them made the decision; the other 19 were given its stored response.
    replayed = [r.headers.get("Idempotent-Replayed") for r in responses]
    assert replayed.count("true") == 19
    assert replayed.count(None) == 1

    assert await event_types(admin_pool, resource) == [*before, "LOCK_ACQUIRED"]
    row = await stored_key(admin_pool, key)
    assert row is not None
    assert json.loads(row["response"]) == responses[0].json()


async def test_concurrent_reuse_of_a_key_on_two_resources_appends_once(
    http: httpx.AsyncClient, unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    """Both requests can decide and append at once; the key's row makes one statement fail as a whole,
    so the loser's events vanish with it and it is told the key was used for another request."""
    for attempt in range(5):
        key = new_key()
        resources = [f"{unique_prefix}{attempt}:a", f"{unique_prefix}{attempt}:b"]
        responses = await asyncio.gather(
            *(
                http.post(f"/v1/locks/{r}/acquire", json={"owner": "bot1"}, headers={"Idempotency-Key": key})
                for r in resources
            )
        )
        assert sorted(r.status_code for r in responses) == [201, 422], [r.text for r in responses]
        winner = next(i for i, r in enumerate(responses) if r.status_code == 201)
        assert_problem(responses[1 - winner], 422, "idempotency_key_reused")
        assert await event_types(admin_pool, resources[winner]) == ["LOCK_ACQUIRED"]
        assert await event_types(admin_pool, resources[1 - winner]) == []
        loser_view = await http.get(f"/v1/locks/{resources[1 - winner]}")
        assert loser_view.status_code == 404  # no projection row left behind either
        row = await stored_key(admin_pool, key)
        assert row is not None
        assert row["resource"] == resources[winner]


async def _send_and_hang_up(host: str, port: int, path: str, body: bytes, key: str) -> None:
    """Write a complete HTTP/1.1 request, then close the socket without reading a byte of the response."""
    _reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: {host}:{port}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Idempotency-Key: {key}\r\n"
        "Connection: close\r\n"
        "\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def _retry_until_decided(
    http: httpx.AsyncClient, path: str, body: bytes, key: str, timeout_s: float = 10.0
) -> httpx.Response:
    """What a client does after a lost response: retry with the same key while told to come back later."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await http.post(
            path, content=body, headers={"Idempotency-Key": key, "Content-Type": "application/json"}
        )
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.05)


async def _wait_for_key(admin_pool: asyncpg.Pool, key: str, timeout_s: float = 5.0) -> asyncpg.Record | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = await stored_key(admin_pool, key)
        if row is not None:
            return row
        await asyncio.sleep(0.02)
    return None


@pytest.mark.parametrize("retry_when", ["at-once-1", "at-once-2", "at-once-3", "after-first-committed"])
async def test_retry_after_a_lost_response_takes_the_lock_once(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, retry_when: str
) -> None:
    key = new_key()
    path = f"/v1/locks/{resource}/acquire"
    body = json.dumps({"owner": "bot1", "ttl_ms": 20_000}).encode()
    host, port = http.base_url.host, http.base_url.port
    assert host == "127.0.0.1"
    assert port is not None

    await _send_and_hang_up(host, port, path, body, key)
    if retry_when == "after-first-committed":
        # The server finishes a command whose client hung up (and stores its outcome under the key)...
        first = await _wait_for_key(admin_pool, key)
        assert first is not None, "the request whose client hung up was never decided"
    retried = await _retry_until_decided(http, path, body, key)

    # Whether the first request was decided before, after or while the retry ran, the retry gets the
    # lease (fresh or replayed), and the lock was taken once.
    assert retried.status_code == 201, retried.text
    if retry_when == "after-first-committed":
        # ...so the retry is given that outcome instead of taking the lock a second time.
        assert retried.headers["Idempotent-Replayed"] == "true"
    lease = retried.json()
    assert lease["owner"] == "bot1"
    assert lease["fencing_token"] == 1
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]
    row = await stored_key(admin_pool, key)
    assert row is not None
    assert json.loads(row["response"]) == retried.json()

    # Once the key is stored no request with it can append again (a request still in flight finds the
    # key when it loads, or loses the expected-version race and then finds it), so the count above is
    # final; a further retry confirms it is a replay of the same outcome.
    again = await _retry_until_decided(http, path, body, key)
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == retried.content
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]


@pytest.mark.parametrize(
    "other_body",
    [{"owner": "bot2", "ttl_ms": 20_000}, {"owner": "bot1", "ttl_ms": 25_000}, {"owner": "bot1"}],
    ids=["other-owner", "other-ttl", "default-ttl"],
)
async def test_same_key_with_another_request_is_refused(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool, other_body: dict[str, Any]
) -> None:
    key = new_key()
    url = f"/v1/locks/{resource}/acquire"
    first = await http.post(url, json={"owner": "bot1", "ttl_ms": 20_000}, headers={"Idempotency-Key": key})
    assert first.status_code == 201

    reused = await http.post(url, json=other_body, headers={"Idempotency-Key": key})
    problem = assert_problem(reused, 422, "idempotency_key_reused")
    assert "Idempotent-Replayed" not in reused.headers
    assert problem["type"].endswith("idempotency_key_reused")

    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]
    row = await stored_key(admin_pool, key)
    assert row is not None
    assert json.loads(row["response"]) == first.json()


async def test_same_key_on_another_resource_or_command_is_refused(
    http: httpx.AsyncClient, unique_prefix: str, admin_pool: asyncpg.Pool
) -> None:
    key = new_key()
    first_resource, other_resource = f"{unique_prefix}a", f"{unique_prefix}b"
    first = await http.post(
        f"/v1/locks/{first_resource}/acquire", json={"owner": "bot1"}, headers={"Idempotency-Key": key}
    )
    assert first.status_code == 201
    token = first.json()["fencing_token"]

    elsewhere = await http.post(
        f"/v1/locks/{other_resource}/acquire", json={"owner": "bot1"}, headers={"Idempotency-Key": key}
    )
    assert_problem(elsewhere, 422, "idempotency_key_reused")
    assert await event_types(admin_pool, other_resource) == []

    other_command = await http.post(
        f"/v1/locks/{first_resource}/release",
        json={"owner": "bot1", "fencing_token": token},
        headers={"Idempotency-Key": key},
    )
    assert_problem(other_command, 422, "idempotency_key_reused")
    assert await event_types(admin_pool, first_resource) == ["LOCK_ACQUIRED"]


async def test_renew_and_release_retried_with_a_key_each(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    acquired = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": 20_000})
    assert acquired.status_code == 201
    token = acquired.json()["fencing_token"]

    renew_key, release_key = new_key(), new_key()
    renew_body = {"owner": "bot1", "fencing_token": token, "ttl_ms": 40_000}
    renews = [
        await http.post(
            f"/v1/locks/{resource}/renew", json=renew_body, headers={"Idempotency-Key": renew_key}
        )
        for _ in range(3)
    ]
    assert [r.status_code for r in renews] == [200, 200, 200]
    assert [r.headers.get("Idempotent-Replayed") for r in renews] == [None, "true", "true"]
    assert len({r.content for r in renews}) == 1
    renewed = renews[0].json()
    assert renewed["ttl_ms"] == 40_000
    assert renewed["fencing_token"] == token
    assert renewed["expires_at"] > acquired.json()["expires_at"]  # same ISO format and zone: sortable
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED", "LOCK_RENEWED"]

    release_body = {"owner": "bot1", "fencing_token": token}
    releases = [
        await http.post(
            f"/v1/locks/{resource}/release", json=release_body, headers={"Idempotency-Key": release_key}
        )
        for _ in range(3)
    ]
    assert [r.status_code for r in releases] == [200, 200, 200]
    assert [r.headers.get("Idempotent-Replayed") for r in releases] == [None, "true", "true"]
    assert len({r.content for r in releases}) == 1
    assert releases[0].json() == {
        "resource": resource,
        "owner": "bot1",
        "fencing_token": token,
        "released": True,
    }
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"]

    # A stored outcome is replayed even after the lock moved on: the renew is not decided again
    # (it would be 409 not_holder now, as an unkeyed renew shows).
    late_renew = await http.post(
        f"/v1/locks/{resource}/renew", json=renew_body, headers={"Idempotency-Key": renew_key}
    )
    assert late_renew.status_code == 200
    assert late_renew.content == renews[0].content
    assert_problem(await http.post(f"/v1/locks/{resource}/renew", json=renew_body), 409, "not_holder")
    assert_problem(await http.post(f"/v1/locks/{resource}/release", json=release_body), 409, "not_holder")
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"]

    for key, command in ((renew_key, "renew"), (release_key, "release")):
        row = await stored_key(admin_pool, key)
        assert row is not None
        (metadata,) = await keyed_metadata(admin_pool, resource, key)
        assert metadata["command"] == command


async def test_rejection_is_reevaluated_on_retry(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    """Documents the choice DESIGN.md leaves open: a rejection (409 lock_held) is not stored, so a retry
    with the same key is decided again and succeeds once the lock is free."""
    holder = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": 20_000})
    assert holder.status_code == 201
    token = holder.json()["fencing_token"]

    key = new_key()
    body = {"owner": "bot2", "ttl_ms": 20_000}
    refused = await http.post(f"/v1/locks/{resource}/acquire", json=body, headers={"Idempotency-Key": key})
    problem = assert_problem(refused, 409, "lock_held")
    assert problem["holder"] == "bot1"
    assert await stored_key(admin_pool, key) is None

    still_refused = await http.post(
        f"/v1/locks/{resource}/acquire", json=body, headers={"Idempotency-Key": key}
    )
    assert_problem(still_refused, 409, "lock_held")
    assert "Idempotent-Replayed" not in still_refused.headers

    released = await http.post(
        f"/v1/locks/{resource}/release", json={"owner": "bot1", "fencing_token": token}
    )
    assert released.status_code == 200

    granted = await http.post(f"/v1/locks/{resource}/acquire", json=body, headers={"Idempotency-Key": key})
    assert granted.status_code == 201, granted.text
    assert "Idempotent-Replayed" not in granted.headers
    assert granted.json()["owner"] == "bot2"
    assert granted.json()["fencing_token"] > token

    # From now on the success is what the key stands for.
    replayed = await http.post(f"/v1/locks/{resource}/acquire", json=body, headers={"Idempotency-Key": key})
    assert replayed.status_code == 201
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.content == granted.content
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED", "LOCK_RELEASED", "LOCK_ACQUIRED"]
    row = await stored_key(admin_pool, key)
    assert row is not None
    assert json.loads(row["response"]) == granted.json()


async def test_a_utf8_key_is_stored_shown_and_replayed_as_sent(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    """Header bytes arrive undecoded; a UTF-8 key means its characters, not their Latin-1 reading."""
    key = f"clé-{uuid.uuid4().hex}-€✓"
    correlation = "commande-n°7"
    headers = {b"Idempotency-Key": key.encode(), b"X-Correlation-ID": correlation.encode()}
    url = f"/v1/locks/{resource}/acquire"
    body = {"owner": "bot1", "ttl_ms": 20_000}

    first = await http.post(url, json=body, headers=headers)
    assert first.status_code == 201, first.text
    [metadata] = await keyed_metadata(admin_pool, resource, key)
    assert metadata["idempotency_key"] == key
    assert metadata["correlation_id"] == correlation
    history = (await http.get(f"/v1/locks/{resource}/history")).json()
    assert [e["metadata"].get("idempotency_key") for e in history["events"]] == [key]

    again = await http.post(url, json=body, headers=headers)
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert await event_types(admin_pool, resource) == ["LOCK_ACQUIRED"]
    # The key as its Latin-1 reading is another key: the lock is held, and nothing is replayed.
    misread = {b"Idempotency-Key": key.encode().decode("latin-1").encode()}
    assert_problem(await http.post(url, json=body, headers=misread), 409, "lock_held")


async def test_a_key_that_is_not_utf8_is_refused(
    http: httpx.AsyncClient, resource: str, admin_pool: asyncpg.Pool
) -> None:
    response = await http.post(
        f"/v1/locks/{resource}/acquire", json={"owner": "bot1"}, headers={b"Idempotency-Key": b"k\xff\xfe"}
    )
    problem = assert_problem(response, 422, "validation_error")
    assert problem["errors"] == [
        {
            "loc": ["header", "Idempotency-Key"],
            "msg": "Header value should be UTF-8 text",
            "type": "string_unicode",
        }
    ]
    assert await event_types(admin_pool, resource) == []
