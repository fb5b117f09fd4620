"""What one fleet run does: which scenarios, at what sizes, against what server settings, and the
limits its checks hold the service to (``python -m bench.fleet``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench.output import RESULTS_DIR

SCENARIOS = ("heartbeats", "lapse")
TTL_MIN_MS = 1_000  # the API's bounds on a lease's TTL
TTL_MAX_MS = 3_600_000
LATENESS_LIMIT_S = 10.0  # every lease expired within 10 s of its deadline
LATENESS_P99_LIMIT_S = 1.0
OTHER_LOAD_WARNING_PCT = 15.0  # CPU % (of one core) used by processes outside the run: results disturbed


@dataclass
class HeartbeatParams:
    agents: int = 10_000
    duration_s: float = 60.0
    interval_s: float = 10.0
    ttl_ms: int = 30_000
    concurrency: int = 256  # requests in flight while acquiring and releasing (and HTTP connections)


@dataclass
class LapseParams:
    leases: int = 100_000
    concurrency: int = 256
    ttl_ms: int | None = None  # None: calibrated so that the first deadline falls after creation
    # spread: one TTL for all, so deadlines come at the creation rate; cluster: all at one instant
    deadlines: str = "spread"
    margin_s: float = 15.0  # slack between the estimated end of creation and the first deadline
    calibration: int = 1_000  # acquires (1 s leases on fleet:calib:*) that measure the creation rate
    probe_agents: int = 16
    probe_rate: float = 0.0  # acquire+release cycles/s of the whole probe; 0: closed loop
    probe_baseline_s: float = 3.0  # probe alone before creation, for a reference latency
    expiry_timeout_s: float = 120.0  # give up this long after the last deadline
    poll_interval_s: float = 1.0


@dataclass
class FleetOptions:
    scenarios: tuple[str, ...] = SCENARIOS
    heartbeats: HeartbeatParams = field(default_factory=HeartbeatParams)
    lapse: LapseParams = field(default_factory=LapseParams)
    server_workers: int = 1
    reaper_interval_ms: int = 200
    reaper_batch_size: int = 1_000
    server_env: dict[str, str] = field(default_factory=dict)
    server_log_level: str = "warning"
    output_dir: Path | None = RESULTS_DIR  # None: write nothing
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
