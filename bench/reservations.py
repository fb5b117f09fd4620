"""A route of zones in one reservation against one acquire per zone: ``python -m bench.reservations``.

A fresh database (the bench's embedded PostgreSQL, or a new database on ``--database-url``), one real
lockledger server (authentication on), and ``--workers`` agents in a closed loop, each on zones of its
own (no conflicts: this measures the cost of taking a route, not contention). A cycle takes ``--zones``
zones and gives them back:

- ``reservation``: ``POST /v1/reservations`` with every zone, then one release of the set;
- ``single acquires``: ``POST /v1/locks/{zone}/acquire`` for each zone in turn, then a release each.

The two alternate in rounds of ``--duration`` seconds (``--rounds`` pairs, the order of each pair
swapped every round), so both see the same machine. Per mode: routes taken per second, and the
latency of taking the whole route (the one reservation, or the zones' acquires one after another) p50
and p99. The table gives the medians over the rounds and the ratio reservation ÷ single acquires; one
JSON line per round and a summary in ``bench/results/reservations-*.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from rich.console import Console
from rich.table import Table

from bench.auth import bearer
from bench.cli import positive_int
from bench.database import provision
from bench.output import RESULTS_DIR, JsonLines, default_path
from bench.runner import run_async
from bench.server import LockledgerServer
from bench.stats import latency_ms
from domain.access import Role
from eventstore.dburl import asyncpg_dsn
from service import tokens

RESERVATION, SINGLES = "reservation", "single acquires"
TTL_MS = 30_000


class Failed(RuntimeError):
    """An answer other than the one a free zone gets: the run measures nothing then."""


async def _post(session: aiohttp.ClientSession, path: str, body: dict[str, Any], expected: int) -> Any:
    async with session.post(path, json=body) as answer:
        if answer.status != expected:
            raise Failed(f"POST {path}: {answer.status} {(await answer.text())[:200]}")
        return await answer.json()


async def _reservation(session: aiohttp.ClientSession, zones: list[str]) -> float:
    """Take ``zones`` in one reservation and release the set: how long taking took."""
    started = time.perf_counter()
    taken = await _post(session, "/v1/reservations", {"resources": zones, "ttl_ms": TTL_MS}, 201)
    took = time.perf_counter() - started
    await _post(
        session, f"/v1/reservations/{taken['reservation_id']}/release", {"leases": taken["leases"]}, 200
    )
    return took


async def _singles(session: aiohttp.ClientSession, zones: list[str]) -> float:
    """Take ``zones`` one acquire after another and release each: how long taking took."""
    started = time.perf_counter()
    leases = [await _post(session, f"/v1/locks/{zone}/acquire", {"ttl_ms": TTL_MS}, 201) for zone in zones]
    took = time.perf_counter() - started
    for zone, lease in zip(zones, leases, strict=True):
        await _post(session, f"/v1/locks/{zone}/release", {"fencing_token": lease["fencing_token"]}, 200)
    return took


async def _round(base_url: str, token: str, mode: str, options: argparse.Namespace) -> dict[str, Any]:
    """``--workers`` agents taking routes in ``mode`` for ``--duration`` seconds."""
    cycle = _reservation if mode == RESERVATION else _singles
    took: list[float] = []
    connector = aiohttp.TCPConnector(limit=options.workers)
    async with aiohttp.ClientSession(
        base_url, connector=connector, headers={"Authorization": bearer(token)}
    ) as session:
        deadline = time.perf_counter() + options.duration

        async def agent(worker: int) -> None:
            zones = [f"route:{mode[0]}{worker}:z{zone}" for zone in range(options.zones)]
            while time.perf_counter() < deadline:
                took.append(await cycle(session, zones))

        started = time.perf_counter()
        await asyncio.gather(*(agent(worker) for worker in range(options.workers)))
        elapsed = time.perf_counter() - started
    return {
        "kind": "round", "mode": mode, "routes": len(took), "routes_per_s": round(len(took) / elapsed, 1),
        "take_latency": latency_ms(took),
    }  # fmt: skip


async def measure(url: str, options: argparse.Namespace, out: JsonLines, console: Console) -> dict[str, Any]:
    """Every round, alternating the modes; the summary record (medians and ratios)."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        (token,) = await tokens.create_many(conn, [f"bench-{uuid.uuid4().hex[:6]}"], Role.AGENT)
    finally:
        await conn.close()
    server = LockledgerServer(url, options.server_workers, log_level="warning")
    await asyncio.to_thread(server.start)
    rounds: dict[str, list[dict[str, Any]]] = {RESERVATION: [], SINGLES: []}
    try:
        for index in range(options.rounds):
            pair = (RESERVATION, SINGLES) if index % 2 == 0 else (SINGLES, RESERVATION)
            for mode in pair:
                record = await _round(server.base_url, token, mode, options)
                out.write(record)
                rounds[mode].append(record)
                console.print(
                    f"  {mode}: {record['routes_per_s']:,} routes/s,"
                    f" p99 {record['take_latency']['p99_ms']} ms",
                    highlight=False,
                )
    finally:
        await asyncio.to_thread(server.stop)
    medians = {
        mode: {
            "routes_per_s": statistics.median(r["routes_per_s"] for r in records),
            "p50_ms": statistics.median(r["take_latency"]["p50_ms"] for r in records),
            "p99_ms": statistics.median(r["take_latency"]["p99_ms"] for r in records),
        }
        for mode, records in rounds.items()
    }
    ratios = {
        figure: round(medians[RESERVATION][figure] / medians[SINGLES][figure], 3)
        for figure in ("routes_per_s", "p50_ms", "p99_ms")
    }
    return {
        "kind": "summary", "zones": options.zones, "workers": options.workers, "rounds": options.rounds,
        "duration_s": options.duration, "medians": medians, "reservation_over_singles": ratios,
    }  # fmt: skip


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(
        title=f"a route of {summary['zones']} zones, {summary['workers']} agents, medians of "
        f"{summary['rounds']} rounds",
        title_justify="left",
    )
    for column in ("figure", RESERVATION, SINGLES, "ratio"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    medians, ratios = summary["medians"], summary["reservation_over_singles"]
    for figure, label in (("routes_per_s", "routes/s"), ("p50_ms", "take p50 ms"), ("p99_ms", "take p99 ms")):
        table.add_row(label, f"{medians[RESERVATION][figure]:,}", f"{medians[SINGLES][figure]:,}",
                      f"{ratios[figure]:.3f}")  # fmt: skip
    console.print(table)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.reservations", description=__doc__.split("\n\n")[0])
    p.add_argument("--zones", type=positive_int, default=4, help="zones in a route (default 4)")
    p.add_argument("--workers", type=positive_int, default=32, help="agents, closed loop (default 32)")
    p.add_argument("--duration", type=positive_int, default=8, help="seconds per round (default 8)")
    p.add_argument("--rounds", type=positive_int, default=3, help="pairs of rounds (default 3)")
    p.add_argument("--server-workers", type=positive_int, default=1)
    p.add_argument("--database-url", help="a PostgreSQL server (a superuser): a fresh database")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON lines (default: bench/results/reservations-*)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    out = JsonLines(options.out or default_path("reservations-", RESULTS_DIR))
    db = provision(options.database_url)
    try:
        summary = run_async(partial(measure, db.url, options, out, console))
    except Failed as error:
        console.print(f"[red]{error}[/red]")
        return 1
    finally:
        db.close()
    out.write(summary)
    print_summary(console, summary)
    console.print(f"results: {out.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
