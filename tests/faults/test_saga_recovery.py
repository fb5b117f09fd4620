"""Sagas survive their orchestrator: it is SIGKILLed at every step boundary and in the middle of a
compensation, and a new orchestrator finishes the saga from the server's log alone (``recover_sagas``).

Each scenario runs ``tests/faults/saga_orchestrator.py`` until it kills itself at the chosen point, then
runs it again in recovery mode, and checks what a fleet operator cares about: the saga ended completed
or fully compensated (``aborted``); no lock under the scenario's prefix is left held; no step's effect
was compensated twice (compensations are called again after a crash mid-compensation, and must be
idempotent: the effects file shows whether a call changed anything); no action ran once compensation
began; under ``policy="forward"`` every step's effect happened exactly once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import ServerProcess

pytestmark = [pytest.mark.storage, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("pick", "drive", "drop")


@dataclass(frozen=True)
class Scenario:
    policy: str
    kill_at: str
    fail_at: str | None
    status: str  # what the saga must end as

    @property
    def id(self) -> str:
        fail = f"-fail-{self.fail_at}" if self.fail_at else ""
        return f"{self.policy}-{self.kill_at.replace(':', '-')}{fail}"


SCENARIOS = [
    *(Scenario("compensate", f"{when}:{step}", None, "aborted")
      for step in STEPS for when in ("before", "after", "between") if (when, step) != ("between", "drop")),
    Scenario("compensate", "between:drop", None, "completed"),  # nothing left to run: recovery completes it
    Scenario("compensate", "compensate:drive", "drop", "aborted"),
    Scenario("compensate", "compensate:pick", "drop", "aborted"),
    Scenario("forward", "after:pick", None, "completed"),
    Scenario("forward", "between:drive", None, "completed"),
    Scenario("forward", "before:drop", None, "completed"),
]  # fmt: skip


def _orchestrator(mode: str, server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tests.faults.saga_orchestrator", mode, "--url", server.base_url, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _effects(path: Path, saga: str) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in (json.loads(line) for line in lines if line.strip()) if e["saga"] == saga]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_a_killed_orchestrator_is_finished_by_recovery(
    server: ServerProcess, unique_prefix: str, tmp_path: Path, scenario: Scenario
) -> None:
    agent = f"orchestrator-{uuid.uuid4().hex[:8]}"
    saga = f"{unique_prefix}move"
    effects = tmp_path / "effects.jsonl"
    common = ["--agent", agent, "--prefix", unique_prefix, "--effects", str(effects)]
    common += ["--policy", scenario.policy]
    fail = ["--fail-at", scenario.fail_at] if scenario.fail_at else []

    first = _orchestrator("run", server, *common, "--saga", saga, "--kill-at", scenario.kill_at, *fail)
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    assert f"KILLED AT {scenario.kill_at}" in first.stdout
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        before = http.get(f"/v1/sagas/{saga}").json()
        assert before["status"] in ("running", "compensating"), before

        second = _orchestrator("recover", server, *common)
        assert second.returncode == 0, second.stdout + second.stderr
        assert f"RECOVERED {saga} {scenario.status}" in second.stdout, second.stdout + second.stderr

        view = http.get(f"/v1/sagas/{saga}").json()
        held = http.get("/v1/locks", params={"prefix": unique_prefix}).json()["items"]
    assert view["status"] == scenario.status, view
    assert held == [], held
    statuses = {s["name"]: s["status"] for s in view["steps"]}
    lines = _effects(effects, saga)
    applied = Counter((e["step"], e["kind"]) for e in lines if e["applied"])

    # No step's effect was undone twice, and only steps whose completion was recorded were undone.
    assert all(n == 1 for n in applied.values()), applied
    for step in STEPS:
        undone = applied[(step, "compensate")]
        assert undone == (1 if statuses[step] == "compensated" else 0), (step, statuses, lines)
    started = Counter((e["type"], e["data"].get("step")) for e in view["timeline"])
    assert all(n == 1 for (kind, _), n in started.items() if kind == "COMPENSATION_STARTED"), started

    when, _, cut = scenario.kill_at.partition(":")
    calls = {kind: [e["applied"] for e in lines if (e["step"], e["kind"]) == (cut, kind)]
             for kind in ("action", "compensate")}  # fmt: skip
    if when == "compensate":  # the undo had happened; recovery called it again, and it changed nothing
        assert calls["compensate"] == [True, False], lines
    if (when, scenario.policy) == ("after", "forward"):  # the half-run step was run again, harmlessly
        assert calls["action"] == [True, False], lines

    if scenario.status == "completed":
        assert set(statuses.values()) == {"completed"}
        assert {step: applied[(step, "action")] for step in STEPS} == dict.fromkeys(STEPS, 1), lines
        return
    # Aborted: nothing left half-done, and no action ran once compensating began.
    assert set(statuses.values()) <= {"compensated", "failed", "pending"}, statuses
    kinds = [e["kind"] for e in lines]
    if "compensate" in kinds:
        assert "action" not in kinds[kinds.index("compensate") :], lines
    recovered_pids = {e["pid"] for e in lines} - {e["pid"] for e in lines[:1]}
    assert not [e for e in lines if e["pid"] in recovered_pids and e["kind"] == "action"], lines
    for step in STEPS:
        if statuses[step] == "pending":
            assert not [e for e in lines if e["step"] == step], lines
