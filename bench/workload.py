"""One simulated agent: pick a resource uniformly, acquire, renew k times, release; on conflict pick again.

Agents stop only between cycles, so every lease taken is released before the cell ends and the next cell
starts with no lock held.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from time import perf_counter

from bench.recorder import Recorder
from bench.targets.base import Agent

ERROR_PAUSE_S = 0.01  # after a failed acquire: do not spin on a failing target


@dataclass
class Control:
    stopping: bool = False


def resource_names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


async def run_agent(
    agent: Agent,
    resources: list[str],
    renews: int,
    recorder: Recorder,
    control: Control,
    seed: int,
) -> None:
    rng = random.Random(seed)
    pick = rng.randrange
    n = len(resources)
    while not control.stopping:
        resource = resources[pick(n)]
        started = perf_counter()
        try:
            token = await agent.acquire(resource)
        except Exception as error:
            recorder.error("acquire", error)
            await asyncio.sleep(ERROR_PAUSE_S)
            continue
        acquired_at = perf_counter()
        if token is None:
            recorder.command("conflict", acquired_at - started)
            continue
        recorder.command("acquire", acquired_at - started)
        for _ in range(renews):
            started = perf_counter()
            try:
                await agent.renew(resource, token)
            except Exception as error:
                recorder.error("renew", error)
                break
            recorder.command("renew", perf_counter() - started)
        release_sent_at = perf_counter()
        try:
            await agent.release(resource, token)
        except Exception as error:
            recorder.error("release", error)
            recorder.grant(resource, token, acquired_at, release_sent_at)
            continue
        recorder.command("release", perf_counter() - release_sent_at)
        recorder.cycle()
        recorder.grant(resource, token, acquired_at, release_sent_at)
