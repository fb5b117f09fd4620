"""The lapse scenario: L leases are acquired and left to lapse while the probe keeps serving; then the
log says how late the reaper expired each one.

The leases' TTL is chosen so that none lapses before the creation ends: a short calibration (1 s leases
on ``fleet:calib:*``, at the creation's concurrency, the probe running) measures the creation rate, and
the first deadline is set half as long again as the creation should take, plus a margin, after it
starts. ``spread``: one TTL for all, so the deadlines come at the creation rate; ``cluster``: every lease
is due at one instant. Authentication: one token per creation slot (an agent taking many leases; the
calibration uses the same ones, so it measures the same rate) and one per probe agent.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import datetime
from typing import Any

from bench.auth import agent_names
from bench.fleet_config import LATENESS_LIMIT_S, LATENESS_P99_LIMIT_S, TTL_MAX_MS, TTL_MIN_MS, LapseParams
from bench.fleet_log import clock_offset_s, connect_owner, events_by_type, held, lateness
from bench.fleet_measure import RunContext
from bench.fleet_probe import Probe
from bench.fleet_requests import Agents, bounded, mint_tokens, status_counts
from bench.stats import latency_ms

BACKLOG_POINTS = 120  # at most, of the count of held leases while the reaper works


async def _calibrate(ctx: RunContext, http: Agents, params: LapseParams) -> tuple[float, dict[str, Any]]:
    """The creation rate (acquires/s) at this concurrency, measured on short-lived leases."""
    n_cal = min(params.calibration, max(params.leases // 10, 50))
    cal_status: Counter[int] = Counter()

    def cal_job(i: int) -> Callable[[], Awaitable[None]]:
        async def job() -> None:
            status, _, _ = await http.post_with_retries(
                i % params.concurrency,
                f"/v1/locks/fleet:calib:{ctx.run_id}:{i}/acquire",
                {"ttl_ms": TTL_MIN_MS},
            )
            cal_status[status] += 1

        return job

    loop = asyncio.get_running_loop()
    started = loop.time()
    await bounded(params.concurrency, (cal_job(i) for i in range(n_cal)))
    rate = n_cal / (loop.time() - started)
    return rate, {
        "acquires": n_cal,
        "per_s": round(rate, 1),
        "statuses": status_counts(cal_status),
        "estimated_creation_s": round(params.leases / rate, 1),
    }


async def run_lapse(ctx: RunContext, params: LapseParams) -> dict[str, Any]:
    """L leases acquired and left to lapse while a probe keeps serving; lateness from the log."""
    prefix = f"fleet:lapse:{ctx.run_id}:"
    loop = asyncio.get_running_loop()
    slots = params.concurrency
    auth, minting = await mint_tokens(
        ctx.database_url,
        agent_names(f"fleet-{ctx.run_id}-lapse-", slots)
        + agent_names(f"fleet-{ctx.run_id}-probe-", params.probe_agents),
    )
    creators, probers = auth[:slots], auth[slots:]
    conn = await connect_owner(ctx.database_url)
    try:
        offset_s = await clock_offset_s(conn)
        async with (
            Agents(ctx.host, ctx.port, creators, connections=params.concurrency) as http,
            Agents(ctx.host, ctx.port, probers, connections=max(params.probe_agents, 1)) as probe_http,
        ):
            probe = Probe(probe_http, f"fleet:probe:{ctx.run_id}:", params.probe_agents, params.probe_rate)
            probe.start()
            try:
                baseline_begin = time.time()
                await asyncio.sleep(params.probe_baseline_s)
                baseline_end = time.time()

                ttl_ms, cluster_at = params.ttl_ms, None
                calibration: dict[str, Any] = {}
                if ttl_ms is None:
                    rate, calibration = await _calibrate(ctx, http, params)
                    planned_s = params.leases / rate * 1.5 + params.margin_s
                    if params.deadlines == "cluster":
                        cluster_at = loop.time() + planned_s
                    else:
                        ttl_ms = _clamp_ttl(planned_s * 1000)
                elif params.deadlines == "cluster":
                    cluster_at = loop.time() + ttl_ms / 1000
                ctx.console.print(
                    f"[bold]lapse[/bold]: {params.leases} leases, deadlines {params.deadlines}, "
                    + (
                        f"ttl {ttl_ms} ms"
                        if cluster_at is None
                        else f"all due in {cluster_at - loop.time():.0f} s"
                    )
                    + f"; probe {params.probe_agents} agents"
                    + (f" at {params.probe_rate:g} cycles/s" if params.probe_rate else " (closed loop)")
                )

                # Creation.
                deadlines: list[datetime] = []
                create_status: Counter[int] = Counter()
                create_latency: array[float] = array("d")

                def create_job(i: int) -> Callable[[], Awaitable[None]]:
                    async def job() -> None:
                        ttl = ttl_ms if cluster_at is None else _clamp_ttl((cluster_at - loop.time()) * 1000)
                        status, body, seconds = await http.post_with_retries(
                            i % slots, f"/v1/locks/{prefix}{i}/acquire", {"ttl_ms": ttl}
                        )
                        create_status[status] += 1
                        create_latency.append(seconds)
                        if status == 201:
                            deadlines.append(datetime.fromisoformat(json.loads(body)["expires_at"]))

                    return job

                create_begin_wall = time.time()
                create_begin = ctx.resources.mark()
                await bounded(params.concurrency, (create_job(i) for i in range(params.leases)))
                create_end = ctx.resources.mark()
                create_end_wall = time.time()
                created = len(deadlines)
                create_s = create_end_wall - create_begin_wall
                if not deadlines:
                    raise RuntimeError(f"no lease was created: {status_counts(create_status)}")
                first_deadline = min(deadlines).timestamp() - offset_s  # this machine's wall clock
                last_deadline = max(deadlines).timestamp() - offset_s
                early = sum(1 for d in deadlines if d.timestamp() - offset_s < create_end_wall)
                ctx.console.print(
                    f"  created {created} in {create_s:.1f} s ({created / create_s:,.0f}/s); deadlines "
                    f"{first_deadline - create_end_wall:+.1f} s .. {last_deadline - create_end_wall:+.1f} s "
                    "from now; waiting for the reaper"
                )

                # Wait for the first deadline, then poll until none is held.
                await asyncio.sleep(max(first_deadline - time.time(), 0))
                lapse_begin = ctx.resources.mark()
                give_up = last_deadline + params.expiry_timeout_s
                backlog: list[tuple[float, int]] = []
                still_held = created
                while True:
                    still_held = await held(conn, prefix)
                    now = time.time()
                    backlog.append((round(now - first_deadline, 2), still_held))
                    if still_held == 0 or now > give_up:
                        break
                    await asyncio.sleep(params.poll_interval_s)
                all_expired_wall = time.time()
                lapse_end = ctx.resources.mark()
                await asyncio.sleep(0.5)
            finally:
                await probe.stop()

        late = await lateness(conn, prefix, LATENESS_LIMIT_S)
        events = await events_by_type(conn, prefix)
    finally:
        await conn.close()

    last_expiry = late["last_expiry_epoch"]
    lapse_window_end = (last_expiry - offset_s) if last_expiry is not None else all_expired_wall
    probe_lapse = probe.window(first_deadline, lapse_window_end)
    checks = {
        "all_created": created == params.leases,
        "lapsed_after_creation": early == 0,
        "all_expired": still_held == 0 and late["expired"] == created,
        "none_later_than_10s": late["over_10s"] == 0,
        "lateness_p99_under_1s": (late["p99_s"] or 0.0) < LATENESS_P99_LIMIT_S,
        "probe_no_errors": probe_lapse["errors"] == 0,
    }
    return {
        "kind": "lapse",
        "run_id": ctx.run_id,
        "params": asdict(params),
        "prefix": prefix,
        "tokens": minting,
        "calibration": calibration,
        "ttl_ms": ttl_ms,
        "create": {
            "created": created,
            "seconds": round(create_s, 2),
            "per_s": round(created / create_s, 1),
            "statuses": status_counts(create_status),
            "latency": latency_ms(create_latency),
            "resources": ctx.resources.between(create_begin, create_end),
            "lapsed_before_creation_finished": early,
        },
        "deadlines": {
            "first_after_creation_s": round(first_deadline - create_end_wall, 2),
            "spread_s": round(last_deadline - first_deadline, 2),
        },
        "expiry": {
            **late,
            "still_held": still_held,
            "resources": ctx.resources.between(lapse_begin, lapse_end),
            "client_loop_lag": ctx.loop_lag.between(lapse_begin, lapse_end),
            "backlog": _thin(backlog, BACKLOG_POINTS),
        },
        "events": events,
        "probe": {
            "agents": params.probe_agents,
            "rate": params.probe_rate or "closed loop",
            "baseline": probe.window(baseline_begin, baseline_end),
            "during_creation": probe.window(create_begin_wall, create_end_wall),
            "during_lapse": probe_lapse,
            "statuses": status_counts(probe.statuses),
        },
        "checks": checks,
        "passed": all(checks.values()),
    }


def _clamp_ttl(ms: float) -> int:
    """A TTL the API accepts, at least ``ms``."""
    return int(min(max(math.ceil(ms), TTL_MIN_MS), TTL_MAX_MS))


def _thin(points: list[tuple[float, int]], keep: int) -> list[tuple[float, int]]:
    """About ``keep`` of the points, evenly spaced, and the last."""
    if len(points) <= keep:
        return points
    step = len(points) / keep
    return [points[int(i * step)] for i in range(keep)] + [points[-1]]
