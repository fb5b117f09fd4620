"""The projector runner: keeps every asynchronous projection (``projections/projector.py``) up with the log.

One task per server process steps each projector until it has applied every window open, then pauses
``poll_s``. Several processes may run it at once: a checkpoint moves only from the value its runner read,
so a page applied by two runners commits once and the other rolls back. The database going away is
outlived with a growing pause, as the change feed's reader does; nothing is lost, since the checkpoint
and the applied pages commit together. The lag and the delay from recorded to applied are on
``/metrics``.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg
import structlog
from prometheus_client import Counter, Gauge, Histogram

from projections.agent_stats import AGENT_STATS
from projections.holding_periods import HOLDING_PERIODS
from projections.projector import SETTLE, Projection, Projector
from service.stopping import pause_unless_stopped

log = structlog.get_logger("lockledger.projectors")

LAG = Gauge(
    "lockledger_projector_lag_seconds",
    "Seconds since the newest snapshot whose committed events this process's projector has all applied",
    ["projector"],
)
DELAY = Histogram(
    "lockledger_projector_delay_seconds",
    "Per event: seconds from its recorded_at to the commit that applied it to the projection",
    ["projector"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
APPLIED = Counter("lockledger_projector_events_total", "Events applied by projectors", ["projector"])

PROJECTIONS = (HOLDING_PERIODS, AGENT_STATS)


@dataclass(frozen=True, slots=True)
class Status:
    """A projector as ``/readyz`` reports it."""

    name: str
    lag_s: float | None  # None: it has not caught up once since this process started
    covered_until: datetime | None  # replay may read its table for instants up to here


class ProjectorRunner:
    def __init__(
        self,
        pool: asyncpg.Pool,
        projections: tuple[Projection, ...] = PROJECTIONS,
        *,
        poll_s: float = 0.1,
        settle: timedelta = SETTLE,
    ) -> None:
        self._pool = pool
        self._poll_s = poll_s
        self.projectors = [Projector(projection, settle=settle) for projection in projections]
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        for projector in self.projectors:
            LAG.labels(projector.table).set_function(functools.partial(_lag, projector))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="projectors")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    def status(self) -> list[Status]:
        return [
            Status(
                p.table,
                p.lag_s(),
                None if p.checkpoint is None else p.checkpoint.covered_until,
            )
            for p in self.projectors
        ]  # fmt: skip

    async def run_once(self) -> int:
        """Step every projector until each has caught up once; the events applied."""
        total = 0
        async with self._pool.acquire() as conn:
            for projector in self.projectors:
                while True:
                    if self._stop.is_set():
                        return total
                    step = await projector.step(conn)
                    total += step.applied
                    if step.applied:
                        APPLIED.labels(projector.table).inc(step.applied)
                        for delay in step.delays:
                            DELAY.labels(projector.table).observe(delay)
                    if step.caught_up:
                        break
        return total

    async def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                await self.run_once()
                failures = 0
                await pause_unless_stopped(self._stop, self._poll_s)
            except Exception as exc:  # the database down, a pool timeout: the runner must outlive them
                failures += 1
                log.warning("projector step failed; retrying", error=repr(exc), failures=failures)
                await pause_unless_stopped(self._stop, min(5.0, self._poll_s * 2**failures))


def _lag(projector: Projector) -> float:
    lag = projector.lag_s()
    return float("nan") if lag is None else lag
