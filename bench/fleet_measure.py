"""The fleet run's instruments, and the context that hands them to a scenario.

``Resources`` is ``bench.sampler`` over the server, PostgreSQL, this process and the machine, sampled
every 0.5 s and at the edges of each phase (``mark``), so that each phase (acquiring, renewing, creating,
lapsing) is told its own CPU and memory. ``LoopLag`` watches how late this process's event loop wakes
from a short sleep: a busy or blocked load generator (or a starved CPU) shows there, so client-side
delay is not mistaken for server latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from bench.sampler import Sample, Sampler, others_pct
from bench.stats import latency_ms

SAMPLE_INTERVAL_S = 0.5
LOOP_LAG_PERIOD_S = 0.02
BUSIEST_PROCESSES = 4  # per group, in a phase's figures
PROCESS_SHARE_MIN_PCT = 0.5  # a process busier than this is named


class Resources:
    """CPU and RSS of each process group (name -> root pid; None: this process) over a run's phases."""

    def __init__(self, groups: dict[str, int | None]) -> None:
        self._sampler = Sampler(groups, interval_s=SAMPLE_INTERVAL_S)

    def start(self) -> None:
        self._sampler.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self._sampler.stop)

    def mark(self) -> Sample:
        """A sample now: where a phase begins or ends."""
        return self._sampler.snapshot()

    def between(self, start: Sample, end: Sample) -> dict[str, Any]:
        """CPU % (100 = one core) and peak RSS (MB, of the group and of its largest process) of each group
        between two marks; its busiest processes' CPU %; and what processes outside the groups took."""
        elapsed = max(end.at - start.at, 1e-9)
        window = [s for s in list(self._sampler.samples) if start.at <= s.at <= end.at] or [end]
        out: dict[str, Any] = {"window_s": round(elapsed, 2)}
        cpu: dict[str, float | None] = {}
        for name in end.cpu_s:
            cpu[name] = round((end.cpu_s[name] - start.cpu_s[name]) / elapsed * 100, 1)
            # Per process, busiest first: shows how evenly the server's workers share the load.
            before, after = start.process_cpu_s[name], end.process_cpu_s[name]
            shares = sorted(
                ((after[pid] - before.get(pid, 0.0)) / elapsed * 100 for pid in after), reverse=True
            )
            out[name] = {
                "cpu_pct": cpu[name],
                "peak_rss_mb": round(max(s.rss[name] for s in window) / 2**20, 1),
                "peak_process_rss_mb": round(max(s.rss_max[name] for s in window) / 2**20, 1),
                "process_cpu_pct": [
                    round(share, 1) for share in shares[:BUSIEST_PROCESSES] if share >= PROCESS_SHARE_MIN_PCT
                ],
            }
        out["other_cpu_pct"] = others_pct(cpu)
        return out


class LoopLag:
    """How late this process's event loop wakes from a ``period_s`` sleep, sampled until ``stop``."""

    def __init__(self, period_s: float = LOOP_LAG_PERIOD_S) -> None:
        self._period_s = period_s
        self.at: array[float] = array("d")  # time.perf_counter(), as the sampler's marks
        self.lag: array[float] = array("d")
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self._period_s)
            self.lag.append(loop.time() - before - self._period_s)
            self.at.append(time.perf_counter())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def between(self, start: Sample, end: Sample) -> dict[str, Any]:
        """p50, p99 and max lag (ms) between two marks."""
        summary = latency_ms(
            lag for at, lag in zip(self.at, self.lag, strict=True) if start.at <= at <= end.at
        )
        return {key: summary[key] for key in ("p50_ms", "p99_ms", "max_ms")}


@dataclass
class RunContext:
    """What a scenario is given: the server's address, the database, the run id its names carry, the
    instruments and the progress console."""

    host: str
    port: int
    database_url: str
    run_id: str
    resources: Resources
    console: Console
    loop_lag: LoopLag
