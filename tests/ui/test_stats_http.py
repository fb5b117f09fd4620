"""``GET /v1/stats`` over real HTTP: commands counted once by outcome, the live leases, the process id; and
``GET /v1/stats/agents``: an agent's holds, ends and lapses from the agent_stats projector."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from domain.access import Role

if TYPE_CHECKING:
    from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


def count(stats: dict[str, Any], command: str, outcome: str) -> int:
    return int(stats["commands"].get(command, {}).get(outcome, 0))


async def test_commands_are_counted_by_outcome(http: httpx.AsyncClient, resource: str) -> None:
    before = (await http.get("/v1/stats")).json()
    granted = await http.post(
        f"/v1/locks/{resource}/acquire",
        json={"owner": "a", "ttl_ms": 60_000},
        headers={"Idempotency-Key": resource},
    )
    assert granted.status_code == 201, granted.text
    again = await http.post(
        f"/v1/locks/{resource}/acquire",
        json={"owner": "a", "ttl_ms": 60_000},
        headers={"Idempotency-Key": resource},
    )
    assert again.headers["idempotent-replayed"] == "true"
    assert (await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "b"})).status_code == 409
    token = granted.json()["fencing_token"]
    assert (
        await http.post(f"/v1/locks/{resource}/release", json={"owner": "b", "fencing_token": token})
    ).status_code == 409
    assert (
        await http.post(f"/v1/locks/{resource}/renew", json={"owner": "a", "fencing_token": token})
    ).status_code == 200
    assert (
        await http.post(f"/v1/locks/{resource}/release", json={"owner": "a", "fencing_token": token})
    ).status_code == 200

    after = (await http.get("/v1/stats")).json()
    assert after["process"] == before["process"]  # one worker: the same process answered both
    assert datetime.fromisoformat(after["at"]) >= datetime.fromisoformat(before["at"])
    # Other tests share the server: at least ours were counted, each under its outcome.
    for command, outcome, ours in [
        ("acquire", "granted", 1),
        ("acquire", "replayed", 1),
        ("acquire", "lock_held", 1),
        ("release", "not_holder", 1),
        ("renew", "renewed", 1),
        ("release", "released", 1),
    ]:
        assert count(after, command, outcome) - count(before, command, outcome) >= ours, (command, outcome)
    assert after["leases_held"] >= 0
    assert after["leases_expired"] >= 0

    metrics = (await http.get("/metrics")).text
    assert 'lockledger_commands_total{command="acquire",outcome="lock_held"}' in metrics


async def test_the_dashboard_role_reads_stats_and_the_replay_but_not_the_history(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    dashboard = await issue_token(f"{unique_prefix}wall", Role.DASHBOARD)
    headers = {"Authorization": f"Bearer {dashboard}"}
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30.0) as client:
        for path in ("/v1/stats", "/v1/replay/state?at=2020-01-01T00:00:00Z",
                     "/v1/replay/changes?from=2020-01-01T00:00:00Z&to=2020-01-01T00:01:00Z"):  # fmt: skip
            assert (await client.get(path, headers=headers)).status_code == 200, path
        for path in ("/v1/events", "/v1/agents/a/history", f"/v1/locks/{unique_prefix}x/history"):
            assert (await client.get(path, headers=headers)).status_code == 403, path
        assert (await client.get("/v1/stats")).status_code == 401


async def test_agent_stats_count_a_hold_and_its_end_within_the_projector_lag(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    zone = f"{unique_prefix}dock"
    agent = f"{unique_prefix}agv"
    tokens = {}
    for bay in ("b1", "b2"):
        granted = await http.post(f"/v1/locks/{zone}:{bay}/acquire", json={"owner": agent, "ttl_ms": 60_000})
        assert granted.status_code == 201, granted.text
        tokens[bay] = granted.json()["fencing_token"]
    released = await http.post(
        f"/v1/locks/{zone}:b1/release", json={"owner": agent, "fencing_token": tokens["b1"]}
    )
    assert released.status_code == 200, released.text
    expected = {"owner": agent, "holds": 2, "ended": 1, "lapses": 0}
    for _ in range(100):  # the server's projector polls every 100 ms
        page = (await http.get("/v1/stats/agents", params={"zone_prefix": zone})).json()
        if page["items"] and {k: page["items"][0][k] for k in expected} == expected:
            break
        await asyncio.sleep(0.05)
    assert len(page["items"]) == 1
    assert {k: page["items"][0][k] for k in expected} == expected
    assert page["items"][0]["mean_hold_ms"] >= 0
    assert (await http.get("/v1/stats/agents", params={"zone_prefix": "no-such-zone"})).json() == {
        "items": []
    }
