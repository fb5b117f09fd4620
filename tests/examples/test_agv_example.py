"""The AGV saga example runs against a real server and tells its story: the pallet is picked, the zone
is occupied, the drive times out, the pallet is put back and released; and the log can prove it later:
the fleet's state replayed at an instant inside the saga shows ``pallet:42`` held by the AGV."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.servers import ServerProcess

pytestmark = [pytest.mark.storage, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agv_pallet_to_zone.py"
TIMELINE_LINE = re.compile(r"^\s+(\S+Z|\S+\+00:00)\s+([A-Z_]+)\s*(\S*)$")


def test_the_example_tells_its_story_and_the_log_can_replay_it(server: ServerProcess) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", server.base_url, "--drive-timeout", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env={k: v for k, v in os.environ.items() if k != "LOCKLEDGER_TOKEN"},  # dev mode: no token
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert "agv-23 occupies zone:B1" in out
    assert "pick: lifting pallet:42 from dock:3" in out
    assert "saga failed at step drive: timeout" in out
    assert "compensate pick: putting pallet 42 back on dock:3" in out
    assert "drive: entering" not in out
    assert "pallet:42 is free; zone:B1 is held by agv-23" in out
    assert out.rstrip().endswith("the story ran as told")

    [saga_id] = re.findall(r"^saga (move-pallet-42-\w+) is aborted$", out, re.MULTILINE)
    timeline = [m.groups() for m in map(TIMELINE_LINE.match, out.splitlines()) if m]
    assert [(kind, step) for _, kind, step in timeline] == [
        ("SAGA_STARTED", ""),
        ("STEP_STARTED", "pick"),
        ("STEP_COMPLETED", "pick"),
        ("STEP_STARTED", "drive"),
        ("STEP_FAILED", "drive"),
        ("COMPENSATION_STARTED", "pick"),
        ("COMPENSATION_COMPLETED", "pick"),
        ("SAGA_ABORTED", ""),
    ]
    # While the drive waited for the zone, the AGV held the pallet: replay says so from the log alone.
    inside = next(at for at, kind, step in timeline if (kind, step) == ("STEP_STARTED", "drive"))
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        state = http.get("/v1/replay/state", params={"at": inside, "prefix": "pallet:42"}).json()
    [lease] = [lock for lock in state["locks"] if lock["resource"] == "pallet:42"]
    assert lease["owner"] == "agv-17"
    assert (lease["saga_id"], lease["saga_step"]) == (saga_id, "pick")
