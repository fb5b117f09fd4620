"""One fleet run: its PostgreSQL, the server with its reaper, the instruments, then each scenario, and
the JSON records they leave (an environment record first, then one per scenario).

The server is ``bench.server``'s (authentication on, as in production), with the reaper's interval and
batch size this run asks for. The database is the one given (migrated first; the run's names carry its
run id, so a database may be reused) or the throughput bench's own kind of embedded cluster
(``bench.database.provision``: migrated, its WAL segments made).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.auth import AUTH
from bench.database import inspect_server, provision
from bench.environment import environment as machine_environment
from bench.fleet_config import FleetOptions
from bench.fleet_heartbeats import run_heartbeats
from bench.fleet_lapse import run_lapse
from bench.fleet_measure import LoopLag, Resources, RunContext
from bench.server import LockledgerServer


@contextlib.contextmanager
def database(database_url: str | None, console: Console) -> Iterator[str]:
    """The URL of the database to run on: the given one, migrated, or an embedded cluster's."""
    from migrations.upgrade import upgrade

    if database_url:
        upgrade(database_url)
        yield database_url
        return
    console.print("starting the embedded PostgreSQL")
    bench_db = provision(None)
    try:
        wal = bench_db.info["wal_segments_prepared"]
        console.print(f"prepared {wal['segments']} WAL segments in {wal['seconds']} s")
        yield bench_db.url
    finally:
        bench_db.close()


def environment(options: FleetOptions, settings: dict[str, Any]) -> dict[str, Any]:
    """The machine and software record the throughput bench writes too (``settings``: the server's
    version and settings, ``bench.database.server_settings``), and this run's own settings."""
    settings = dict(settings)
    return {
        "kind": "environment",
        "run_id": options.run_id,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, "-m", "bench.fleet", *sys.argv[1:]]),
        **machine_environment(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "postgresql": settings.pop("postgresql"),
        "postgresql_settings": settings,
        "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "server_workers": options.server_workers,
        "auth": AUTH,
        "reaper_interval_ms": options.reaper_interval_ms,
        "reaper_batch_size": options.reaper_batch_size,
    }


@contextlib.asynccontextmanager
async def running_server(
    database_url: str, options: FleetOptions, console: Console
) -> AsyncIterator[LockledgerServer]:
    env = {
        "LOCKLEDGER_REAPER_ENABLED": "true",
        "LOCKLEDGER_REAPER_INTERVAL_MS": str(options.reaper_interval_ms),
        "LOCKLEDGER_REAPER_BATCH_SIZE": str(options.reaper_batch_size),
        **options.server_env,
    }
    server = LockledgerServer(
        database_url, options.server_workers, env=env, log_level=options.server_log_level
    )
    await asyncio.to_thread(server.start)
    console.print(f"server {server.base_url} ({options.server_workers} workers), log {server.log_path}")
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


def check_alive(server: LockledgerServer) -> None:
    """Raise if the server exited during a scenario (its figures would be meaningless)."""
    if (status := server.exited()) is not None:
        raise RuntimeError(
            f"lockledger serve exited during the run (status {status}; another process may have signalled "
            f"it):\n{server.log_tail(40)}"
        )


async def run_fleet(
    database_url: str, options: FleetOptions, console: Console | None = None
) -> list[dict[str, Any]]:
    """Start the server on ``database_url`` (already migrated), run the scenarios, return JSON records."""
    console = console or Console(stderr=True)
    postmaster, settings = await inspect_server(database_url)
    records: list[dict[str, Any]] = [environment(options, settings)]
    async with running_server(database_url, options, console) as server:
        groups: dict[str, int | None] = {"server": server.pid, "client": None}
        if postmaster is not None:
            groups["postgres"] = postmaster
        resources = Resources(groups)
        resources.start()
        loop_lag = LoopLag()
        loop_lag.start()
        try:
            ctx = RunContext(
                server.host, server.port, database_url, options.run_id, resources, console, loop_lag
            )
            begin = resources.mark()
            if "heartbeats" in options.scenarios:
                records.append(await run_heartbeats(ctx, options.heartbeats))
                check_alive(server)
            if "lapse" in options.scenarios:
                records.append(await run_lapse(ctx, options.lapse))
                check_alive(server)
            records[0]["whole_run_resources"] = resources.between(begin, resources.mark())
        finally:
            await loop_lag.stop()
            await resources.stop()
    return records
