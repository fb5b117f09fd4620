"""``GET /v1/stats`` over real HTTP: commands counted once by outcome, the live leases, the process id."""

from __future__ import annotations

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
