"""One timestamp shape in every answer (domain/timestamps.py): RFC 3339, UTC, microseconds, ``Z``.

Every JSON answer the API gives is walked: a field named ``*_at`` is null or in that shape, and so is
every instant written inside any text (a problem's ``detail``). The commands' answers are written by
the database (``to_char``), everything else by Python; both must agree byte for byte, and a replay of an
Idempotency-Key stays the first answer's bytes.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import httpx
import pytest

from domain.timestamps import SQL_TIMESTAMP_FORMAT, TIMESTAMP_PATTERN, format_timestamp

pytestmark = pytest.mark.storage

TIMESTAMP = re.compile(TIMESTAMP_PATTERN)
# Anything that looks like an instant in ISO 8601, in whatever shape: each must be the one shape.
LOOKS_LIKE_AN_INSTANT = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}[0-9:.]*(?:Z|[+-]\d{2}:?\d{2})?")


def instants(value: Any, where: str = "") -> list[tuple[str, str]]:
    """Every (place, text) in a JSON document that is, or is inside, an instant-like string; fails on a
    ``*_at`` field that is neither null nor a string."""
    found: list[tuple[str, str]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            place = f"{where}.{key}"
            if key.endswith("_at"):
                assert item is None or isinstance(item, str), (place, item)
                if isinstance(item, str):
                    found.append((place, item))
                    continue
            found += instants(item, place)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += instants(item, f"{where}[{index}]")
    elif isinstance(value, str):
        found += [(where, match) for match in LOOKS_LIKE_AN_INSTANT.findall(value)]
    return found


class Answers:
    """Sends requests and keeps every JSON answer, to check them all at the end."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.bodies: list[tuple[str, Any]] = []

    async def send(self, method: str, path: str, expected: int, **kwargs: Any) -> httpx.Response:
        response = await self.http.request(method, path, **kwargs)
        assert response.status_code == expected, (method, path, response.text)
        assert response.headers["content-type"].split(";")[0] in (
            "application/json",
            "application/problem+json",
        )
        self.bodies.append((f"{method} {path} {response.status_code}", response.json()))
        return response


async def test_every_answer_writes_instants_one_way(http: httpx.AsyncClient, unique_prefix: str) -> None:
    answers = Answers(http)
    resource = f"{unique_prefix}zone"
    key = {"Idempotency-Key": f"ts-{uuid.uuid4()}"}
    body = {"owner": "bot1", "ttl_ms": 20_000}

    first = await answers.send("POST", f"/v1/locks/{resource}/acquire", 201, json=body, headers=key)
    replay = await answers.send("POST", f"/v1/locks/{resource}/acquire", 201, json=body, headers=key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.content == first.content
    token = first.json()["fencing_token"]
    await answers.send("POST", f"/v1/locks/{resource}/acquire", 409, json={"owner": "bot2"})  # lock_held
    await answers.send(
        "POST", f"/v1/locks/{resource}/renew", 200, json={"owner": "bot1", "fencing_token": token}
    )
    await answers.send("GET", f"/v1/locks/{resource}", 200)
    await answers.send("GET", "/v1/locks", 200, params={"prefix": unique_prefix})
    await answers.send(
        "POST", f"/v1/locks/{resource}/release", 200, json={"owner": "bot1", "fencing_token": token}
    )
    await answers.send("POST", f"/v1/locks/{resource}/force-release", 200, json={"reason": "check"})

    # A lease that lapses: lease_expired names when, then the reaper (or the next acquire) ends it.
    short = f"{unique_prefix}short"
    lapsing = await answers.send(
        "POST", f"/v1/locks/{short}/acquire", 201, json={"owner": "bot1", "ttl_ms": 1_000}
    )
    await asyncio.sleep(1.1)
    renew = {"owner": "bot1", "fencing_token": lapsing.json()["fencing_token"]}
    await answers.send("POST", f"/v1/locks/{short}/renew", 410, json=renew)
    await answers.send("POST", f"/v1/locks/{short}/acquire", 201, json={"owner": "bot2"})
    await answers.send("GET", f"/v1/locks/{short}/history", 200)
    await answers.send("GET", f"/v1/locks/{resource}/history", 200)

    # Many commands at once: the batched commit statement writes its answers too.
    batch = [f"{unique_prefix}batch:{i}" for i in range(24)]
    responses = await asyncio.gather(
        *(http.post(f"/v1/locks/{r}/acquire", json={"owner": "bot1"}) for r in batch)
    )
    for r, response in zip(batch, responses, strict=True):
        assert response.status_code == 201
        answers.bodies.append((f"POST /v1/locks/{r}/acquire", response.json()))

    name = f"{unique_prefix}agent"
    await answers.send("POST", "/v1/tokens", 201, json={"name": name, "role": "agent"})
    await answers.send("DELETE", f"/v1/tokens/{name}", 200)
    listed = await answers.send("GET", "/v1/tokens", 200, params={"include_revoked": "true"})
    [entry] = [t for t in listed.json()["items"] if t["name"] == name]
    assert isinstance(entry["created_at"], str)
    assert isinstance(entry["revoked_at"], str)
    await answers.send("GET", "/healthz", 200)
    await answers.send("GET", "/readyz", 200)
    await answers.send("GET", "/v1/locks/never-locked-here", 404)

    checked = [(label, place, text) for label, body in answers.bodies for place, text in instants(body)]
    wrong = [(label, place, text) for label, place, text in checked if not TIMESTAMP.fullmatch(text)]
    assert wrong == []
    # The walk saw the instants that matter, from each kind of answer.
    places = {place for _, place, _ in checked}
    assert {".expires_at", ".detail", ".expired_at", ".updated_at", ".acquired_at"} <= places
    assert {".events[0].recorded_at", ".events[0].data.expires_at", ".events[1].data.expires_at"} <= places
    assert ".items[0].created_at" in places
    assert sum(1 for label, place, _ in checked if "batch" in label and place == ".expires_at") == 24


@pytest.mark.parametrize(
    "instant",
    [
        datetime(2026, 5, 5, 9, 30, tzinfo=UTC),  # no fraction at all
        datetime(2026, 5, 5, 9, 30, 0, 500_000, tzinfo=UTC),  # trailing zeros
        datetime(2026, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        datetime(2000, 2, 29, 0, 0, 0, 1, tzinfo=timezone(timedelta(hours=5, minutes=30))),  # another offset
        datetime(999, 1, 1, tzinfo=UTC),  # a three-digit year is still four digits
    ],
)
async def test_the_database_writes_instants_as_python_does(
    admin_pool: asyncpg.Pool, instant: datetime
) -> None:
    written = await admin_pool.fetchval(
        f"SELECT to_char($1::timestamptz AT TIME ZONE 'UTC', '{SQL_TIMESTAMP_FORMAT}')", instant
    )
    assert written == format_timestamp(instant)
    assert TIMESTAMP.fullmatch(written)


async def test_the_log_and_its_export_write_instants_one_way(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    """Every writer of the log (the single append, the batched commit, the reaper, a takeover) stores its
    instants in the answers' shape, so the export and the feed print what the API prints."""
    resource, lapsing = f"{unique_prefix}zone", f"{unique_prefix}lapse"
    acquired = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1"})
    token = acquired.json()["fencing_token"]
    holder = {"owner": "bot1", "fencing_token": token}
    assert (await http.post(f"/v1/locks/{resource}/renew", json=holder)).status_code == 200
    assert (await http.post(f"/v1/locks/{resource}/release", json=holder)).status_code == 200
    assert (await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot2"})).status_code == 201
    forced = await http.post(f"/v1/locks/{resource}/force-release", json={"reason": "check"})
    assert forced.status_code == 200
    batch = [f"{unique_prefix}batch:{i}" for i in range(16)]
    replies = await asyncio.gather(
        *(http.post(f"/v1/locks/{r}/acquire", json={"owner": "bot1"}) for r in batch)
    )
    assert {reply.status_code for reply in replies} == {201}
    # One lapse the reaper ends (the shared server reaps every tenth of a second), one a takeover ends.
    for name in (lapsing, f"{lapsing}:taken"):
        reply = await http.post(f"/v1/locks/{name}/acquire", json={"owner": "bot1", "ttl_ms": 1_000})
        assert reply.status_code == 201
    await asyncio.sleep(1.1)
    assert (await http.post(f"/v1/locks/{lapsing}:taken/acquire", json={"owner": "bot2"})).status_code == 201
    for _ in range(100):
        history = (await http.get(f"/v1/locks/{lapsing}/history")).json()
        if history["events"][-1]["type"] == "LOCK_EXPIRED":
            break
        await asyncio.sleep(0.1)

    export = await http.get("/v1/events", params={"prefix": unique_prefix})
    assert export.status_code == 200
    lines = [json.loads(line) for line in export.text.splitlines()]
    types = {line["type"] for line in lines}
    assert types == {"LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED", "LOCK_FORCE_RELEASED", "LOCK_EXPIRED"}
    expiries = [line["metadata"] for line in lines if line["type"] == "LOCK_EXPIRED"]
    assert len(expiries) == 2  # the reaper's and the takeover's
    assert "reaper" in {metadata.get("actor") for metadata in expiries}
    checked = [(place, text) for line in lines for place, text in instants(line["data"], line["type"])]
    checked += [(line["type"], line["recorded_at"]) for line in lines]
    assert len(checked) == 2 * len(lines)  # each event's deadline and its recorded_at
    assert [(place, text) for place, text in checked if not TIMESTAMP.fullmatch(text)] == []
