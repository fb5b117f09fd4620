"""One benchmark run: provision PostgreSQL, start the server, run every cell, write and print the results.

Cells run mode by mode, W by W, all targets one after the other at each W, so slow drift on the machine
(another process, table growth) spreads over all targets instead of favouring one. Each (target, mode)
has its own resource names, shared by its W cells; agents release everything before a cell ends. The
server runs with authentication on: before any load, one API token per agent (max W of them) is minted
in one statement, and agent i of every HTTP cell (lockledger, noop, the calibration) sends token i.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.auth import AUTH, agent_names, mint_agent_tokens
from bench.calibrate import calibrate
from bench.cell import CellSpec, run_cell
from bench.collector import quiet_gc
from bench.config import HTTP_TARGETS, BenchConfig
from bench.database import BenchDatabase, provision
from bench.environment import environment
from bench.http_client import make_client
from bench.output import JsonLines, default_path
from bench.ratios import MIN_KEPT_UP_PCT, answered_pct, check_goals, compute_ratios
from bench.repeats import median_cells
from bench.server import LockledgerServer
from bench.targets.base import Target
from bench.targets.http_api import LOCKS_PREFIX, NOOP_PREFIX, HttpLockTarget
from bench.workload import resource_names

Cell = dict[str, Any]
OTHERS_NOTE_PCT = 15.0


def run_async(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` to its end on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


class BenchRun:
    def __init__(self, config: BenchConfig, console: Console, db: BenchDatabase) -> None:
        self.config = config
        self.console = console
        self.db = db
        self.run_id = uuid.uuid4().hex[:6]
        self.out = JsonLines(config.out or default_path())
        self.cells: list[Cell] = []
        self.notes: list[str] = [
            "CPU % is of one core (this machine has "
            f"{os.cpu_count()}); server, PostgreSQL and load generator share them. For raw-sql, "
            "eventsourcing and redis the load generator runs the client library itself, so its CPU "
            "includes the driver (for eventsourcing, the whole library). other CPU% is what processes "
            "outside the bench took during the window.",
        ]
        self.calibration: dict[str, Any] | None = None
        self.http_client = config.http_client
        self.redis_version: str | None = None
        self.redis_pid: int | None = None
        self._baselines: dict[str, Target] = {}
        self._names: dict[str, list[str]] = {}
        self.tokens: list[str] = []  # agent i's API token, for every HTTP cell

    # targets -------------------------------------------------------------------------------------------
    async def _baseline(self, name: str) -> Target | None:
        if name in self._baselines:
            return self._baselines[name]
        config = self.config
        target: Target
        if name == "raw-sql":
            from bench.targets.raw_sql import RawSqlTarget

            target = RawSqlTarget(self.db.url, config.pool_size, config.ttl_ms)
        elif name == "eventsourcing":
            from bench.targets.es import EventsourcingTarget

            target = EventsourcingTarget(self.db.url, config.pool_size, config.ttl_ms)
        elif name == "redis":
            from bench.targets.redis_lock import RedisTarget, redis_answers, redis_pid

            self.redis_version = await redis_answers(config.redis_url)
            if self.redis_version is None:
                self.notes.append(f"redis skipped: nothing answered at {config.redis_url}")
                self.console.print(f"[yellow]redis skipped: no answer at {config.redis_url}[/yellow]")
                self._baselines.pop(name, None)
                return None
            self.redis_pid = await redis_pid(config.redis_url)
            target = RedisTarget(config.redis_url, self.run_id, config.ttl_ms)
        else:
            raise ValueError(f"unknown target {name!r}")
        await target.open()
        self._baselines[name] = target
        return target

    def _http_target(self, name: str, server: LockledgerServer) -> Target:
        prefix = LOCKS_PREFIX if name == "lockledger" else NOOP_PREFIX
        client = make_client(self.http_client, server.host, server.port, self.config.request_timeout_s)
        return HttpLockTarget(
            name, prefix, client, self.run_id, self.config.ttl_ms, self.tokens, wait_ms=self.config.wait_ms
        )

    async def _mint_tokens(self) -> None:
        """One agent token per simulated agent (the largest W), all in one statement."""
        names = agent_names(f"bench-{self.run_id}-agent-", max(self.config.workers))
        started = time.perf_counter()
        self.tokens = await mint_agent_tokens(self.db.url, names)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        self.console.print(f"minted {len(self.tokens)} agent API tokens in {elapsed_ms:.0f} ms")
        self.notes.append(
            f"authentication on: each HTTP agent (lockledger, noop and the calibration alike) sends its own "
            f"API token (Authorization: Bearer; {len(self.tokens)} agent tokens), whose name owns its "
            "leases; each server process remembers the tokens it has seen and polls for revocations "
            "(LOCKLEDGER_AUTH_CACHE_S, 10 s), so a request costs a dict lookup and a SHA-256, and an "
            "agent one database lookup per run"
        )

    def _resources(self, target: str, mode: str, server_workers: int | None) -> list[str]:
        key = f"{target}-{mode}-{server_workers}"
        if key not in self._names:
            short = target.replace("-", "")
            prefix = f"b{self.run_id}.{short}.sw{server_workers or 0}.{mode}."
            self._names[key] = resource_names(prefix, self.config.resources(mode))
        return self._names[key]

    # the run -------------------------------------------------------------------------------------------
    def _groups(self, server: LockledgerServer | None) -> dict[str, int | None]:
        groups: dict[str, int | None] = {"loadgen": None}
        if server is not None:
            groups["server"] = server.pid
        if self.db.postgres_pid is not None:
            groups["postgres"] = self.db.postgres_pid
        if self.redis_pid is not None:
            groups["redis"] = self.redis_pid
        return groups

    def _plan(self) -> int:
        config = self.config
        http = [t for t in config.targets if t in HTTP_TARGETS]
        other = [t for t in config.targets if t not in HTTP_TARGETS]
        per_pass = len(config.modes) * len(config.workers) * config.repeat
        return per_pass * (len(http) * len(config.server_workers) + len(other))

    async def run(self) -> dict[str, Any]:
        config = self.config
        total = self._plan()
        done = 0
        wants_http = any(t in HTTP_TARGETS for t in config.targets)
        if wants_http:
            await self._mint_tokens()
        for pass_index, server_workers in enumerate(config.server_workers):
            targets = [t for t in config.targets if t in HTTP_TARGETS or pass_index == 0]
            if not targets:
                continue
            server: LockledgerServer | None = None
            if wants_http:
                server = LockledgerServer(self.db.url, server_workers)
                self.console.print(
                    f"starting lockledger serve --workers {server_workers} on port {server.port}"
                )
                await asyncio.to_thread(server.start)
            try:
                if server is not None and self.calibration is None and config.http_client == "auto":
                    await self._calibrate(server)
                for mode in config.modes:
                    for workers in config.workers:
                        for round_index in range(config.repeat):
                            for name in targets:
                                done += 1
                                await self._cell(
                                    name, mode, workers, server_workers, server, done, total, round_index
                                )
            finally:
                if server is not None:
                    await asyncio.to_thread(server.stop)
        for target in self._baselines.values():
            await target.close()
        return self._summary()

    async def _ensure_server(self, server: LockledgerServer) -> None:
        """A server that died (it never should) is reported, and started again for the next cells."""
        status = server.exited()
        if status is None:
            return
        note = f"lockledger serve (workers {server.workers}) exited with {status}; its log: {server.log_path}"
        self.notes.append(note + ":\n" + server.log_tail(15))
        self.console.print(f"[red]{note}; starting it again[/red]\n{server.log_tail(15)}", highlight=False)
        server.stop()
        server.log_path = server.log_path.with_suffix(".restarted.log")
        await asyncio.to_thread(server.start)

    async def _calibrate(self, server: LockledgerServer) -> None:
        config = self.config
        workers = min(16, max(config.workers))
        self.console.print(f"calibrating the HTTP client (no-op endpoint, W={workers})")
        self.calibration = await calibrate(
            server.host,
            server.port,
            workers=workers,
            duration_s=0.6 if config.quick else 1.5,
            timeout_s=config.request_timeout_s,
            process_groups=self._groups(server),
            run_id=self.run_id,
            tokens=self.tokens,
        )
        self.http_client = self.calibration["chosen"]
        costs = ", ".join(
            f"{k} {self.calibration[k]['cpu_ms_per_request']} ms/request" for k in ("aiohttp", "httptools")
        )
        self.console.print(f"HTTP client: [bold]{self.http_client}[/bold] ({costs} of client CPU)")

    async def _cell(
        self,
        name: str,
        mode: str,
        workers: int,
        server_workers: int,
        server: LockledgerServer | None,
        done: int,
        total: int,
        round_index: int = 0,
    ) -> None:
        config = self.config
        http = name in HTTP_TARGETS
        if http:
            assert server is not None
            target: Target | None = self._http_target(name, server)
        else:
            target = await self._baseline(name)
        if target is None:
            return
        spec = CellSpec(
            target=name,
            mode=mode,
            resources=config.resources(mode),
            workers=workers,
            server_workers=server_workers if http else None,
            duration_s=config.duration_s,
            warmup_s=config.warmup_s,
            renews=config.renews,
            rate=config.rate,
        )
        if http:
            assert server is not None
            await self._ensure_server(server)
        where = f" (server workers {server_workers})" if http else ""
        if config.repeat > 1:
            where += f", run {round_index + 1} of {config.repeat}"
        self.console.print(
            f"[{done}/{total}] {name} {mode} R={spec.resources:,} W={workers}{where}: "
            f"{config.warmup_s:g} s warm-up + {config.duration_s:g} s",
            highlight=False,
        )
        settled = await self.db.settle()
        with quiet_gc():
            cell = await run_cell(
                spec,
                target,
                self._resources(name, mode, spec.server_workers),
                self._groups(server),
                drain_timeout_s=config.drain_timeout_s,
                seed=config.seed,
                metrics_url=f"{server.base_url}/metrics" if http and server and server.workers == 1 else None,
            )
        if http:
            await target.close()
            assert server is not None
            if (status := server.exited()) is not None:
                cell["server_exit"] = {
                    "status": status,
                    "log_tail": server.log_tail(),
                    "log": str(server.log_path),
                }
        cell["settled"] = settled
        cell["http_client"] = self.http_client if http else None
        cell["round"] = round_index
        self.cells.append(cell)
        self.out.write(cell)
        viol = "" if cell["violations"] is None else f", {cell['violations']} violations"
        color = "red" if cell["errors"] or cell["violations"] else "green"
        self.console.print(
            f"    [{color}]{cell['cycles_per_s']:,.0f} cycles/s, {cell['conflicts_per_s']:,.0f} conflicts/s, "
            f"{cell['errors']} errors{viol}[/{color}]",
            highlight=False,
        )
        for sample, count in cell["error_samples"].items():
            self.console.print(f"    [red]{count} x {sample}[/red]", highlight=False)

    def _contention_note(self) -> None:
        others = [c["other_cpu_pct"] for c in self.cells if c["other_cpu_pct"] is not None]
        if others and (mean := sum(others) / len(others)) >= OTHERS_NOTE_PCT:
            self.notes.append(
                f"other processes on this machine took {mean:.0f}% of a core on average during the windows "
                f"(max {max(others):.0f}%): every target had less CPU than on a quiet machine"
            )

    def _open_loop_note(self) -> None:
        rate = self.config.rate
        if rate is None:
            return
        behind = sorted(
            {
                f"{c['target']} {c['mode']} W={c['workers']}"
                for c in self.cells
                if (answered_pct(c, rate) or 0.0) < MIN_KEPT_UP_PCT
            }
        )
        self.notes.append(
            f"open loop: every cell was offered {rate:g} attempts/s, spread evenly over its agents, and an "
            "acquire's latency counts from its scheduled start; the ratios compare targets at that one load"
            + (f"; fell behind the schedule: {', '.join(behind)}" if behind else "")
        )

    def _summary(self) -> dict[str, Any]:
        self._contention_note()
        self._open_loop_note()
        reported = median_cells(self.cells)
        ratios = compute_ratios(reported)
        config = asdict(self.config)
        config["out"] = str(self.out.path)
        config["database_url"] = "given" if self.config.database_url else None
        env = environment()
        env.update(
            {
                "postgresql": self.db.info,
                "redis": self.redis_version,
                "http_client": self.http_client,
                "http_client_calibration": self.calibration,
                "event_loop": _loop_name(),
                "auth": AUTH if self.tokens else None,
                "agent_tokens": len(self.tokens),
            }
        )
        return {
            "type": "summary",
            "run_id": self.run_id,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "cells": len(self.cells),
            "ratios": ratios,
            "goals": check_goals(reported, ratios, every_run=self.cells),
            "errors": sum(c["errors"] for c in self.cells),
            "violations": sum(c["violations"] or 0 for c in self.cells),
            "notes": self.notes,
            "environment": env,
            "config": config,
        }


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(config: BenchConfig, console: Console | None = None) -> tuple[Path, list[Cell], dict[str, Any]]:
    """Run the whole benchmark; the JSON lines path, the cells and the summary."""
    console = console or Console(stderr=True)
    console.print("provisioning PostgreSQL" + (" (embedded)" if not config.database_url else ""))
    db = provision(config.database_url)
    try:
        bench = BenchRun(config, console, db)
        console.print(f"PostgreSQL {db.info.get('postgresql')}; results to {bench.out.path}")

        async def main() -> dict[str, Any]:
            return await bench.run()

        summary = run_async(main)
        bench.out.write(summary)
        return bench.out.path, bench.cells, summary
    finally:
        with contextlib.suppress(Exception):
            db.close()
