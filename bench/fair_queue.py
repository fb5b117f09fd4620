"""FIFO wake-up latency across two servers: ``python -m bench.fair_queue --waiters 100``.

A fresh database (the bench's embedded PostgreSQL, or a new database on ``--database-url``) and two real
lockledger servers on it (authentication on). One agent takes a lock; ``--waiters`` agents then ask for
it with ``wait_ms``, alternately through each server, one after another, so the queue's order is known
(docs/decisions/0049-fair-queues.md). Once all of them are queued, the holder releases, and each waiter,
once granted, releases at once through the *other* server than the one that granted it: every hand-over
crosses servers, woken by the database's NOTIFY. The wake-up latency of a hand-over is the time from
sending the release to receiving the next waiter's grant (one release round trip, the NOTIFY, the
waiter's read and commit). Prints a table (p50, p99, max), checks that the grants came in queue order,
and writes one JSON line to ``bench/results/fair-queue-*.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
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
from domain.access import Role
from eventstore.dburl import asyncpg_dsn
from service import tokens

RESOURCE = "dock:fair-queue"
WAIT_MS = 60_000
SERVER_ENV = {"LOCKLEDGER_MAX_WAIT_MS": str(WAIT_MS)}


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank rule."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


async def _queued(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM lock_queue WHERE resource = $1", RESOURCE))


async def run(url: str, waiters: int) -> dict[str, Any]:
    """One round of ``waiters`` hand-overs; the record."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        names = [f"bench-{uuid.uuid4().hex[:6]}-{i}" for i in range(waiters + 1)]
        issued = await tokens.create_many(conn, names, Role.AGENT)
        servers = [LockledgerServer(url, 1, env=SERVER_ENV, log_level="warning") for _ in range(2)]
        await asyncio.gather(*(asyncio.to_thread(server.start) for server in servers))
        try:
            sessions = [aiohttp.ClientSession(server.base_url) for server in servers]
            try:
                return await _hand_overs(conn, sessions, names, issued)
            finally:
                await asyncio.gather(*(session.close() for session in sessions))
        finally:
            await asyncio.gather(*(asyncio.to_thread(server.stop) for server in servers))
    finally:
        await conn.close()


async def _hand_overs(
    conn: asyncpg.Connection, sessions: list[aiohttp.ClientSession], names: list[str], issued: list[str]
) -> dict[str, Any]:
    headers = [{"Authorization": bearer(token)} for token in issued]
    path = f"/v1/locks/{RESOURCE}"
    async with sessions[0].post(f"{path}/acquire", json={"ttl_ms": 60_000}, headers=headers[0]) as answer:
        assert answer.status == 201, await answer.text()
        token = (await answer.json())["fencing_token"]
    granted: asyncio.Queue[tuple[int, float, dict[str, Any]]] = asyncio.Queue()

    async def wait(number: int) -> None:
        server = number % 2
        body = {"ttl_ms": 60_000, "wait_ms": WAIT_MS}
        async with sessions[server].post(f"{path}/acquire", json=body, headers=headers[number]) as answer:
            lease = await answer.json()
            received = time.perf_counter()
            assert answer.status == 201, lease
        await granted.put((number, received, lease))

    tasks = []
    for number in range(1, len(names)):
        tasks.append(asyncio.create_task(wait(number)))
        while await _queued(conn) < number:  # noqa: ASYNC110  (one at a time: the queue order is known)
            await asyncio.sleep(0.005)

    latencies: list[float] = []
    order: list[int] = []
    holder, server = 0, 0
    for _ in range(len(names) - 1):
        body = {"fencing_token": token}
        sent = time.perf_counter()
        async with sessions[1 - server].post(f"{path}/release", json=body, headers=headers[holder]) as answer:
            assert answer.status == 200, await answer.text()
        holder, received, lease = await granted.get()
        latencies.append(received - sent)
        order.append(holder)
        token, server = lease["fencing_token"], holder % 2
    async with sessions[0].post(f"{path}/release", json={"fencing_token": token}, headers=headers[holder]):
        pass
    await asyncio.gather(*tasks)
    ms = [s * 1000 for s in latencies]
    return {
        "kind": "fair_queue", "servers": 2, "waiters": len(names) - 1,
        "in_queue_order": order == sorted(order),
        "wake_ms_p50": percentile(ms, 0.5), "wake_ms_p99": percentile(ms, 0.99), "wake_ms_max": max(ms),
        "wake_ms_mean": statistics.fmean(ms),
    }  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fair_queue", description=__doc__.split("\n\n")[0])
    p.add_argument("--waiters", type=positive_int, default=100, help="acquires queued (default 100)")
    p.add_argument("--database-url", help="a PostgreSQL server (a superuser): a fresh database")
    p.add_argument("--out", type=Path, default=None, help="JSON lines (default: bench/results/fair-queue-*)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    console = Console()
    db = provision(options.database_url)
    try:
        record = run_async(lambda: run(db.url, options.waiters))
    finally:
        db.close()
    out = JsonLines(options.out or default_path("fair-queue-", RESULTS_DIR))
    out.write(record)
    table = Table(title="FIFO wake-up across two servers (release sent → next grant received)")
    for column in ("waiters", "in queue order", "p50 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right")
    table.add_row(
        str(record["waiters"]), str(record["in_queue_order"]), f"{record['wake_ms_p50']:.2f}",
        f"{record['wake_ms_p99']:.2f}", f"{record['wake_ms_max']:.2f}",
    )  # fmt: skip
    console.print(table)
    console.print(f"results: {out.path}")
    return 0 if record["in_queue_order"] else 1


if __name__ == "__main__":
    sys.exit(main())
