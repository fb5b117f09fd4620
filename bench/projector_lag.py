"""The projector's delay under load: ``python -m bench.projector_lag --rate 1000 --duration 30``.

A fresh database (the bench's embedded PostgreSQL, or a new database on ``--database-url``), one real
lockledger server (authentication on, its holding_periods projector running as in production), and an
open-loop load offering ``--rate`` events/s: acquire-then-release cycles (two events each) started at a
fixed pace on distinct resources, whatever the answers' speed. Afterwards ``/metrics`` gives the
server's own histogram of the delay from each event's ``recorded_at`` to the commit that applied it to
``holding_periods`` (``lockledger_projector_delay_seconds``); the p50, p99 and p99.9 reported are the
upper bounds of the buckets they fall in. One JSON line in ``bench/results/projector-lag-*.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from bench.auth import bearer
from bench.cli import positive_int
from bench.database import provision
from bench.output import RESULTS_DIR, JsonLines, default_path
from bench.runner import run_async
from bench.server import LockledgerServer
from domain.access import Role
from eventstore.dburl import asyncpg_dsn
from service import tokens

DELAY = "lockledger_projector_delay_seconds"
QUANTILES = (0.5, 0.99, 0.999)


def quantile_bounds(buckets: list[tuple[float, float]], count: float) -> dict[str, float | None]:
    """For each of QUANTILES, the upper bound of the first cumulative bucket reaching it."""
    found: dict[str, float | None] = {}
    for q in QUANTILES:
        bound = next((le for le, cumulative in buckets if cumulative >= q * count), None)
        found[f"p{q * 100:g}_s_at_most"] = bound
    return found


def delay_histogram(metrics_text: str) -> tuple[list[tuple[float, float]], float]:
    """The holding_periods projector's cumulative delay buckets (upper bound, count) and its count."""
    buckets: list[tuple[float, float]] = []
    count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.labels.get("projector") != "holding_periods":
                continue
            if sample.name == f"{DELAY}_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == f"{DELAY}_count":
                count = sample.value
    return sorted(buckets), count


async def _offer(base_url: str, token: str, rate: float, duration_s: float) -> dict[str, int]:
    """Start a cycle every 2/rate s for ``duration_s``; the answers by status."""
    statuses: dict[str, int] = {}
    headers = {"Authorization": bearer(token)}
    async with aiohttp.ClientSession(base_url, headers=headers) as session:

        async def cycle(i: int) -> None:
            resource = f"bay:{i}"
            try:
                async with session.post(f"/v1/locks/{resource}/acquire", json={"ttl_ms": 30_000}) as r:
                    statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
                    lease = await r.json()
                async with session.post(
                    f"/v1/locks/{resource}/release", json={"fencing_token": lease["fencing_token"]}
                ) as r:
                    statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
            except (aiohttp.ClientError, KeyError) as error:
                statuses[type(error).__name__] = statuses.get(type(error).__name__, 0) + 1

        tasks: set[asyncio.Task[None]] = set()
        started = time.perf_counter()
        i = 0
        while (elapsed := time.perf_counter() - started) < duration_s:
            due = int(elapsed * rate / 2)
            while i < due:
                task = asyncio.create_task(cycle(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
    return statuses


async def measure(url: str, options: argparse.Namespace) -> dict[str, Any]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        (token,) = await tokens.create_many(conn, [f"bench-{uuid.uuid4().hex[:6]}"], Role.AGENT)
    finally:
        await conn.close()
    server = LockledgerServer(url, 1, log_level="warning")
    await asyncio.to_thread(server.start)
    try:
        statuses = await _offer(server.base_url, token, options.rate, options.duration)
        await asyncio.sleep(2.0)  # the last events applied
        async with aiohttp.ClientSession(server.base_url) as session, session.get("/metrics") as r:
            buckets, count = delay_histogram(await r.text())
    finally:
        await asyncio.to_thread(server.stop)
    return {
        "kind": "projector_lag", "rate_offered": options.rate, "duration_s": options.duration,
        "answers": statuses, "events_applied": count, **quantile_bounds(buckets, count),
        "buckets": buckets,
    }  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.projector_lag", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=positive_int, default=1_000, help="events/s offered (default 1000)")
    p.add_argument("--duration", type=positive_int, default=30, help="seconds of load (default 30)")
    p.add_argument("--database-url", help="a PostgreSQL server (a superuser): a fresh database")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON lines (default: bench/results/projector-lag-*)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    console = Console()
    db = provision(options.database_url)
    try:
        record = run_async(lambda: measure(db.url, options))
    finally:
        db.close()
    out = JsonLines(options.out or default_path("projector-lag-", RESULTS_DIR))
    out.write(record)
    console.print({k: v for k, v in record.items() if k != "buckets"})
    console.print(f"results: {out.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
