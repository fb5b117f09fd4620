"""Orphaned sagas: `lockledger simulate` runs while the service is SIGKILLed again and again and comes back.

While the service is dead, every orchestrator's heartbeats and commands fail: some sagas are cut short
and left to their agent's recovery, and an agent the run ends in the middle of its work leaves its saga
to the server. Whatever a kill cut, no saga may stay running: the server compensates a saga whose lease
lapsed, or marks it stuck at the second lapse, so once the simulator has waited out that deadline (two
saga leases and a margin for the reaper) it finds none of its sagas running or compensating, and the
server agrees. Before saga leases, 13 sagas stayed running or compensating forever in such a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.faults.processes import ServerFactory

pytestmark = [pytest.mark.storage, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
AGENTS = 6
KILLS = 3
SECONDS_BETWEEN_KILLS = 2.5
SAGA_LEASE_S = 2.0


def test_no_saga_outlives_its_lease_when_the_service_is_killed_under_the_simulator(
    database_url: str, unique_prefix: str, start_server: ServerFactory
) -> None:
    server = start_server(database_url, {"LOCKLEDGER_REAPER_INTERVAL_MS": "100"})
    args = [
        "simulate", "--agents", str(AGENTS), "--duration", str(KILLS * SECONDS_BETWEEN_KILLS + 5),
        "--seed", "11", "--pallets", "3", "--zones", "2", "--saga-lease", str(SAGA_LEASE_S),
        "--crash-probability", "0.1", "--drop-probability", "0.05", "--prefix", unique_prefix,
        "--format", "json", "--url", server.base_url,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOCKLEDGER_URL", "LOCKLEDGER_TOKEN")}
    simulation = subprocess.Popen(
        [sys.executable, "-m", "lockledger.cli", *args],
        env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    kills = 0
    try:
        # A restart takes longer on a busy machine: the kills stop when the run does, and at least the
        # first falls inside it (the run is several kill intervals long).
        for _ in range(KILLS):
            time.sleep(SECONDS_BETWEEN_KILLS)
            if simulation.poll() is not None:
                break
            server.kill()
            server.start()
            kills += 1
        out, err = simulation.communicate(timeout=180)
    finally:
        if simulation.poll() is None:
            simulation.kill()
            simulation.wait(10)

    assert kills >= 1, "the simulator ended before the first kill"
    summary = json.loads(out)
    print(f"\nsimulate under {kills} service kills: {summary}")
    assert summary["sagas_started"] > 0
    # Whether an agent saw an error, or its SDK retried through every kill, depends on where the kills cut
    # in: reported (errors), not asserted. The kills fell inside the run (asserted above).
    assert summary["sagas_unfinished"] == 0, summary["violation_examples"]
    assert summary["violations"] == 0, summary["violation_examples"]
    assert simulation.returncode == 0, err
    # The server agrees: none of the run's sagas is running or compensating now.
    lapsed: dict[str, int] = {}
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        for n in range(1, AGENTS + 1):
            owner = f"{unique_prefix}agv-{n:02d}"
            for status in ("running", "compensating"):
                left = http.get("/v1/sagas", params={"owner": owner, "status": status}).json()["items"]
                assert left == [], f"{owner}: {status} sagas {[s['saga_id'] for s in left]}"
            for status in ("completed", "aborted", "stuck"):
                ended = http.get("/v1/sagas", params={"owner": owner, "status": status, "limit": 1000})
                count = sum(s["lease_lapsed_at"] is not None for s in ended.json()["items"])
                lapsed[status] = lapsed.get(status, 0) + count
    # How many sagas the server had to finish depends on where the kills cut in: reported, not asserted.
    print(f"sagas the server found lapsed, by how they ended: {lapsed}")
