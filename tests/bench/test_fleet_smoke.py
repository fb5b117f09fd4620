"""bench.fleet at a very small size: heartbeating agents lose nothing, lapsed leases
are all expired promptly, and the service keeps serving meanwhile.

The full sizes (10,000 agents, 100,000 leases) are `python -m bench.fleet`; this keeps the module working.
"""

from __future__ import annotations

import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

# pytest puts tests/ on sys.path for the conftest, where `bench` would be the namespace package tests/bench;
# with the repository root first, `bench` is the project's benchmark package.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.database import RECORDED_SETTINGS  # noqa: E402
from bench.environment import environment as machine_environment  # noqa: E402
from bench.fleet import FleetOptions, HeartbeatParams, LapseParams, parse_args, run_fleet  # noqa: E402
from bench.fleet_report import print_report  # noqa: E402


def test_fleet_options() -> None:
    options, database_url = parse_args(["--quick", "--scenario", "lapse", "--concurrency", "32"])
    assert database_url is None
    assert options.scenarios == ("lapse",)
    assert (options.heartbeats.agents, options.heartbeats.duration_s, options.lapse.leases) == (
        500,
        15.0,
        5_000,
    )
    assert options.heartbeats.concurrency == options.lapse.concurrency == 32
    assert parse_args([])[0].scenarios == ("heartbeats", "lapse")


@pytest.mark.storage
@pytest.mark.slow
async def test_fleet_small(database_url: str) -> None:
    options = FleetOptions(
        heartbeats=HeartbeatParams(agents=200, duration_s=6, interval_s=2, ttl_ms=5_000, concurrency=64),
        lapse=LapseParams(
            leases=2_000,
            concurrency=64,
            margin_s=2,
            calibration=200,
            probe_agents=4,
            probe_baseline_s=0.5,
            expiry_timeout_s=20,
            poll_interval_s=0.25,
        ),
        output_dir=None,
    )
    records = {record["kind"]: record for record in await run_fleet(database_url, options)}
    environment = records["environment"]
    assert environment["auth"] == "bearer"
    # The same machine record as the throughput bench's, and the same settings, as SHOW prints them.
    assert environment.keys() >= machine_environment().keys()
    assert environment["postgresql_settings"].keys() == set(RECORDED_SETTINGS)
    assert environment["postgresql_settings"]["fsync"] == "on"
    assert environment["postgresql_settings"]["min_wal_size"].endswith("B")  # "80MB", not pg_settings' "80"

    heartbeats = records["heartbeats"]
    print(heartbeats["renew"])
    assert heartbeats["tokens"]["minted"] == 200  # one API token per agent, authentication on
    assert heartbeats["acquire"]["held"] == 200
    assert heartbeats["renew"]["statuses"] == {"200": heartbeats["renew"]["ok"]}
    assert heartbeats["renew"]["ok"] >= 200 * 3  # 6 s of renews every 2 s
    assert heartbeats["renew"]["lost_leases"] == 0
    assert heartbeats["spurious_expiries"] == 0
    assert heartbeats["events"].get("LOCK_RELEASED") == 200

    lapse = records["lapse"]
    expiry = lapse["expiry"]
    print({key: expiry[key] for key in ("expired", "p50_s", "p99_s", "max_s", "peak_rate_per_s")})
    assert lapse["tokens"]["minted"] == 64 + 4  # one per creation slot and one per probe agent
    assert lapse["create"]["created"] == 2_000
    assert lapse["create"]["lapsed_before_creation_finished"] == 0
    assert expiry["still_held"] == 0
    assert expiry["expired"] == expiry["by_reaper"] == 2_000
    assert expiry["over_10s"] == 0
    assert expiry["max_s"] is not None
    assert 0 <= expiry["min_s"] <= expiry["max_s"] < 10
    assert lapse["probe"]["during_lapse"]["commands"] > 0
    assert lapse["probe"]["during_lapse"]["errors"] == 0

    report = StringIO()
    print_report(list(records.values()), Console(file=report, width=200))
    assert "renews/s achieved" in report.getvalue()
    assert "lateness p50 / p95 / p99 / max" in report.getvalue()
