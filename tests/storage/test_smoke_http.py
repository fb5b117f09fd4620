"""A first end-to-end path: acquire, replay by Idempotency-Key, conflict, release, over real HTTP."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.storage


async def test_acquire_replay_conflict_release(http: httpx.AsyncClient, resource: str) -> None:
    first = await http.post(
        f"/v1/locks/{resource}/acquire",
        json={"owner": "bot1", "ttl_ms": 5000},
        headers={"Idempotency-Key": f"{resource}-k1"},
    )
    assert first.status_code == 201
    lease = first.json()
    assert lease["fencing_token"] == 1
    assert lease["owner"] == "bot1"

    again = await http.post(
        f"/v1/locks/{resource}/acquire",
        json={"owner": "bot1", "ttl_ms": 5000},
        headers={"Idempotency-Key": f"{resource}-k1"},
    )
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content

    held = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot2"})
    assert held.status_code == 409
    assert held.headers["content-type"] == "application/problem+json"
    assert held.json()["code"] == "lock_held"
    assert held.json()["holder"] == "bot1"

    released = await http.post(f"/v1/locks/{resource}/release", json={"owner": "bot1", "fencing_token": 1})
    assert released.status_code == 200

    history = (await http.get(f"/v1/locks/{resource}/history")).json()["events"]
    assert [e["type"] for e in history] == ["LOCK_ACQUIRED", "LOCK_RELEASED"]
