"""One cell: W agents against one target in one resource mode, for a warm-up and a measured window."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from bench.recorder import Recorder
from bench.safety import check_grants
from bench.sampler import MACHINE, Sampler, others_pct, usage
from bench.server_metrics import Samples, inside, scrape
from bench.stats import summarize_ms
from bench.targets.base import Target
from bench.workload import Control, Pace, run_agent

LATENCY_COMMANDS = ("acquire", "renew", "release", "conflict")


@dataclass(frozen=True)
class CellSpec:
    target: str
    mode: str
    resources: int
    workers: int
    server_workers: int | None  # HTTP targets only
    duration_s: float
    warmup_s: float
    renews: int
    rate: float | None = None  # attempts per second across the cell's agents (workload.Pace); None: closed


async def run_cell(
    spec: CellSpec,
    target: Target,
    resources: list[str],
    process_groups: dict[str, int | None],
    *,
    drain_timeout_s: float,
    seed: int,
    metrics_url: str | None = None,
) -> dict[str, Any]:
    """Drive the cell and return its JSON object (see report.py for the keys). With ``metrics_url`` (a
    one-worker lockledger server), also what the server's /metrics say of the window."""
    check = target.safety if spec.mode == "hot" else None
    recorder = Recorder(record_grants=check is not None)
    control = Control()
    await target.start_cell(spec.workers)
    sampler = Sampler(process_groups)
    sampler.start()
    before: Samples = {}
    scraped = 0.0
    server_view: dict[str, Any] | None = None
    tasks = [
        asyncio.create_task(
            run_agent(
                target.agent(i),
                resources,
                spec.renews,
                recorder,
                control,
                seed * 100_003 + i,
                None if spec.rate is None else Pace.spread(spec.rate, spec.workers, i),
            )
        )
        for i in range(spec.workers)
    ]
    try:
        await asyncio.sleep(spec.warmup_s)
        if metrics_url is not None:
            before = await asyncio.to_thread(scrape, metrics_url)
            scraped = time.perf_counter()
        recorder.active = True
        window_start = time.perf_counter()
        await asyncio.sleep(spec.duration_s)
        recorder.active = False
        window_end = time.perf_counter()
        if metrics_url is not None:
            after = await asyncio.to_thread(scrape, metrics_url)
            server_view = inside(before, after, time.perf_counter() - scraped)
        control.stopping = True
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
        for task in pending:
            task.cancel()
            recorder.error("drain", TimeoutError(f"agent still busy {drain_timeout_s} s after the window"))
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        control.stopping = True
        samples = await asyncio.to_thread(sampler.stop)
        await target.end_cell()

    window = window_end - window_start
    used = usage(samples, window_start, window_end)
    loadgen_cpu = used.cpu_pct.get("loadgen")
    cell_server_cpu = used.cpu_pct.get("server") if spec.server_workers else None
    cell: dict[str, Any] = {
        "type": "cell",
        "target": spec.target,
        "mode": spec.mode,
        "resources": spec.resources,
        "workers": spec.workers,
        "server_workers": spec.server_workers,
        "renews": spec.renews,
        "duration_s": round(window, 3),
        "warmup_s": spec.warmup_s,
        "offered_per_s": spec.rate,
        "cycles": recorder.cycles,
        "cycles_per_s": round(recorder.cycles / window, 1),
        "conflicts": recorder.conflicts,
        "conflicts_per_s": round(recorder.conflicts / window, 1),
        "requests": recorder.requests,
        "requests_per_s": round(recorder.requests / window, 1),
        "errors": recorder.errors,
        "error_samples": dict(recorder.error_kinds),
        "latency_ms": {c: summarize_ms(recorder.latencies[c]) for c in LATENCY_COMMANDS},
        "server_cpu_pct": cell_server_cpu,
        "server_peak_rss_mb": used.peak_rss_mb.get("server") if spec.server_workers else None,
        "pg_cpu_pct": used.cpu_pct.get("postgres"),
        "redis_cpu_pct": used.cpu_pct.get("redis") if spec.target == "redis" else None,
        "loadgen_cpu_pct": loadgen_cpu,
        "machine_cpu_pct": used.cpu_pct.get(MACHINE),
        "other_cpu_pct": others_pct(used.cpu_pct),
        "loadgen_cpu_ms_per_request": _cpu_per_request(loadgen_cpu, window, recorder.requests, 1e3, 4),
        "server_cpu_us_per_request": _cpu_per_request(cell_server_cpu, window, recorder.requests, 1e6, 1),
        "saturated": saturated(used.cpu_pct, spec.server_workers),
        "inside_server": server_view,
        "target_config": target.describe(),
        "violations": None,
        "safety": None,
    }
    if check is not None:
        report = check_grants(recorder.grants, monotonic_tokens=check.monotonic_tokens)
        cell["violations"] = report.violations
        cell["safety"] = {
            "grants_checked": report.grants,
            "overlaps": report.overlaps,
            "token_regressions": report.token_regressions,
            "tokens_checked": check.monotonic_tokens,
            "examples": report.examples,
        }
    return cell


def _cpu_per_request(
    cpu_pct: float | None, window_s: float, requests: int, unit: float, digits: int
) -> float | None:
    """A process's CPU per request, in ``1/unit`` seconds: its mean CPU rate over the samples inside the
    window times the window the requests were counted in.

    For the server this is steadier than cycles/s from one run to the next on a shared machine, and what
    a ratio between two endpoints of one server comes down to once both keep it busy: a closed loop's
    throughput also moves with latency, this does not."""
    if cpu_pct is None or not requests:
        return None
    return round(cpu_pct / 100 * window_s * unit / requests, digits)


SATURATED_PCT = 85.0  # of one core, for a single-threaded Python process; of all cores for the machine


def saturated(cpu: dict[str, float | None], server_workers: int | None) -> list[str]:
    """Which side ran out of CPU in the window: the server (per worker process), the load generator
    (one Python thread does the work), or the whole machine."""
    found = []
    server = cpu.get("server")
    if server_workers and server is not None and server / server_workers >= SATURATED_PCT:
        found.append("server")
    loadgen = cpu.get("loadgen")
    if loadgen is not None and loadgen >= SATURATED_PCT:
        found.append("loadgen")
    machine = cpu.get(MACHINE)
    if machine is not None and machine >= SATURATED_PCT * (os.cpu_count() or 1):
        found.append("machine")
    return found
