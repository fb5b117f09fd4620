"""The probe: a few agents doing acquire/release cycles on resources of their own while the lapse
scenario creates its leases and the reaper expires them, to show whether the service keeps serving.

Every command's start (wall clock), latency and outcome is kept, so that any stretch of the run (the
probe alone, the creation, the lapse window, known only afterwards) can be summed up after the fact.
With a rate the probe's cycles start on a schedule (spread over its agents); a cycle that comes late
does not make up for itself. Without one each agent starts its next cycle when the last one ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from array import array
from collections import Counter
from typing import Any

from bench.fleet_requests import Agents
from bench.stats import latency_ms

PROBE_TTL_MS = 30_000
RESOURCES_PER_AGENT = 64
ERROR_PAUSE_S = 0.05
ACQUIRE, RELEASE = 0, 1


class Probe:
    """``agents`` probe agents on ``http`` (agent j sends token j), resources ``<prefix><j>:<k>``."""

    def __init__(self, http: Agents, prefix: str, agents: int, rate: float) -> None:
        self._http = http
        self._prefix = prefix
        self._agents = agents
        self._interval = agents / rate if rate > 0 else 0.0  # per agent, between cycle starts
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.wall: array[float] = array("d")  # start of each command (this machine's wall clock)
        self.latency: array[float] = array("d")
        self.ok: array[int] = array("b")
        self.command: array[int] = array("b")  # ACQUIRE or RELEASE
        self.statuses: Counter[int] = Counter()

    def _record(self, wall: float, seconds: float, ok: bool, command: int, status: int) -> None:
        self.wall.append(wall)
        self.latency.append(seconds)
        self.ok.append(1 if ok else 0)
        self.command.append(command)
        self.statuses[status] += 1

    async def _agent(self, j: int) -> None:
        loop = asyncio.get_running_loop()
        next_start = loop.time() + (self._interval * random.random())
        k = 0
        while not self._stop.is_set():
            if self._interval:
                delay = next_start - loop.time()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay)
                    if self._stop.is_set():
                        return
                next_start = max(next_start + self._interval, loop.time())
            resource = f"{self._prefix}{j}:{k % RESOURCES_PER_AGENT}"
            k += 1
            wall = time.time()
            status, body, seconds = await self._http.post(
                j, f"/v1/locks/{resource}/acquire", {"ttl_ms": PROBE_TTL_MS}
            )
            self._record(wall, seconds, status == 201, ACQUIRE, status)
            if status != 201:
                await asyncio.sleep(ERROR_PAUSE_S)
                continue
            token = int(json.loads(body)["fencing_token"])
            wall = time.time()
            status, _, seconds = await self._http.post(
                j, f"/v1/locks/{resource}/release", {"fencing_token": token}
            )
            self._record(wall, seconds, status == 200, RELEASE, status)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._agent(j)) for j in range(self._agents)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def window(self, begin: float, end: float) -> dict[str, Any]:
        """Throughput, errors and latency of the commands started in [begin, end] (wall clock)."""
        picked = [i for i, wall in enumerate(self.wall) if begin <= wall <= end]
        seconds = max(end - begin, 1e-9)
        cycles = sum(1 for i in picked if self.command[i] == RELEASE and self.ok[i])
        return {
            "seconds": round(seconds, 2),
            "commands": len(picked),
            "cycles_per_s": round(cycles / seconds, 1),
            "errors": sum(1 for i in picked if not self.ok[i]),
            "latency": latency_ms(self.latency[i] for i in picked),
            "acquire_latency": latency_ms(self.latency[i] for i in picked if self.command[i] == ACQUIRE),
        }
