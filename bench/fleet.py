"""Fleet scale: heartbeats and the reaper.

Two scenarios against a real lockledger server, a subprocess (``bench.server``), reaper on:

``heartbeats``
    A agents (10,000) each take one lease (`fleet:hb:<run>:<i>`, ttl 30 s), then renew it every 10 s
    for D seconds (60), their first renews spread evenly over one interval (about A/10 renews/s), then
    release. Every renew must answer 200; a 409/410 is a lost lease. Afterwards the log must hold no
    LOCK_EXPIRED on any of those streams (no spurious expiry).

``lapse``
    L leases (100,000) on `fleet:lapse:<run>:<i>` are acquired with a TTL chosen so that all of them lapse
    after the creation finishes, and are left to lapse, while a probe of 16 agents keeps doing
    acquire/release cycles on other resources. When every lease is expired, the expiry lateness
    (``recorded_at`` of LOCK_EXPIRED minus the deadline it carries) is computed from the events table.
    Targets: every lease expired within 10 s of its deadline, lateness p99 < 1 s, no probe error.

Authentication is on, as in production (``LOCKLEDGER_DEV_MODE=false``): before each scenario its agents'
API tokens are minted in one statement (``service.tokens.create_many``) and every request carries its
agent's ``Authorization: Bearer``; the token's name owns the lease, so bodies name no owner. Heartbeats:
one token per agent. Lapse: one token per creation slot (``--concurrency``, each slot an agent taking
many leases; the calibration uses the same ones, so it measures the same rate) and one per probe agent.

Resource and token names carry a run id, so a database may be reused and several runs never mix.
The parts: ``fleet_config`` (sizes and limits), ``fleet_run`` (database, server, instruments),
``fleet_heartbeats``, ``fleet_lapse`` with ``fleet_probe``, ``fleet_requests`` (the agents' HTTP),
``fleet_log`` (what the database says), ``fleet_measure`` (CPU, memory, event-loop lag per phase) and
``fleet_report`` (the tables); the rest is shared with ``python -m bench``.

    python -m bench.fleet                      # both scenarios, default sizes, embedded PostgreSQL
    python -m bench.fleet --quick              # 500 agents x 15 s, 5,000 leases
    python -m bench.fleet --scenario lapse --leases 20000 --server-workers 2
    python -m bench.fleet --scenario lapse --lapse-deadlines cluster   # every deadline at one instant

Prints a table per scenario and writes JSON lines to ``bench/results/fleet-<timestamp>.jsonl``. Exit
status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from bench.cli import positive_int
from bench.fleet_config import SCENARIOS, FleetOptions, HeartbeatParams, LapseParams
from bench.fleet_report import print_report
from bench.fleet_run import database, run_fleet
from bench.output import RESULTS_DIR, JsonLines, default_path
from bench.runner import run_async

__all__ = ["FleetOptions", "HeartbeatParams", "LapseParams", "main", "parse_args", "run_fleet"]


def parse_args(argv: Sequence[str] | None = None) -> tuple[FleetOptions, str | None]:
    """The options, and the database URL (None: start an embedded PostgreSQL)."""
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="500 agents, 15 s, 5,000 leases")
    parser.add_argument("--agents", type=positive_int, help="heartbeating agents (10,000)")
    parser.add_argument("--duration", type=float, help="seconds of heartbeats (60)")
    parser.add_argument("--heartbeat-interval", type=float, default=10.0, help="seconds between renews (10)")
    parser.add_argument(
        "--heartbeat-ttl-ms", type=int, default=30_000, help="lease TTL of the agents (30000)"
    )
    parser.add_argument("--leases", type=positive_int, help="leases left to lapse (100,000)")
    parser.add_argument(
        "--lapse-ttl-ms", type=int, help="fixed TTL of the lapsing leases (default: calibrated)"
    )
    parser.add_argument(
        "--lapse-deadlines",
        choices=["spread", "cluster"],
        default="spread",
        help="spread: one TTL, deadlines at the creation rate; cluster: every deadline at one instant",
    )
    parser.add_argument("--probe-agents", type=int, default=16, help="serving probe agents during the lapse")
    parser.add_argument(
        "--probe-rate", type=float, default=0.0, help="probe cycles/s in total (0: closed loop)"
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=256, help="requests in flight while creating"
    )
    parser.add_argument("--expiry-timeout", type=float, default=120.0, help="seconds after the last deadline")
    parser.add_argument("--server-workers", type=positive_int, default=1)
    parser.add_argument("--reaper-interval-ms", type=int, default=200)
    parser.add_argument("--reaper-batch-size", type=int, default=1_000)
    parser.add_argument("--server-log-level", default="warning", help="uvicorn log level of the server")
    parser.add_argument("--database-url", help="a PostgreSQL to use (migrated first); default: embedded")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    quick = args.quick
    options = FleetOptions(
        scenarios=SCENARIOS if args.scenario == "all" else (args.scenario,),
        heartbeats=HeartbeatParams(
            agents=args.agents or (500 if quick else 10_000),
            duration_s=args.duration or (15.0 if quick else 60.0),
            interval_s=args.heartbeat_interval,
            ttl_ms=args.heartbeat_ttl_ms,
            concurrency=args.concurrency,
        ),
        lapse=LapseParams(
            leases=args.leases or (5_000 if quick else 100_000),
            concurrency=args.concurrency,
            ttl_ms=args.lapse_ttl_ms,
            deadlines=args.lapse_deadlines,
            probe_agents=args.probe_agents,
            probe_rate=args.probe_rate,
            expiry_timeout_s=args.expiry_timeout,
        ),
        server_workers=args.server_workers,
        reaper_interval_ms=args.reaper_interval_ms,
        reaper_batch_size=args.reaper_batch_size,
        server_log_level=args.server_log_level,
        output_dir=args.output_dir,
    )
    return options, args.database_url


def main(argv: Sequence[str] | None = None) -> int:
    options, database_url = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    with database(database_url, console) as url:
        records = run_async(lambda: run_fleet(url, options, console))
    print_report(records, console)
    if options.output_dir is not None:
        out = JsonLines(default_path("fleet-", options.output_dir))
        for record in records:
            out.write(record)
        console.print(f"results: {out.path}")
    return 0 if all(r.get("passed", True) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
