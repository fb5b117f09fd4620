"""One simulated agent: pick a resource uniformly, acquire, renew k times, release; on conflict pick again.

Agents stop only between cycles, so every lease taken is released before the cell ends and the next cell
starts with no lock held.

By default the loop is closed: an agent starts its next cycle as soon as the last one ends, so the
offered load is whatever the target can take, and its latency is set by its throughput (Little's law).
With a ``Pace`` the loop is open: the agent starts an attempt (an acquire, then its renews and release if
granted) on a fixed schedule, and an acquire's latency counts from the scheduled start, not from when the
agent got round to sending it. A target that falls behind the schedule therefore shows the wait in its
latency rather than hiding it (what wrk2 calls correcting for coordinated omission).
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


@dataclass(frozen=True)
class Pace:
    """One attempt every ``interval_s``, the first at ``offset_s`` after the agent starts."""

    interval_s: float
    offset_s: float = 0.0

    @classmethod
    def spread(cls, rate: float, workers: int, index: int) -> Pace:
        """Agent ``index`` of ``workers`` sharing ``rate`` attempts per second: each attempts every
        workers/rate s, and their schedules are staggered by 1/rate, so the target sees an even stream."""
        return cls(interval_s=workers / rate, offset_s=index / rate)


def resource_names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


async def run_agent(
    agent: Agent,
    resources: list[str],
    renews: int,
    recorder: Recorder,
    control: Control,
    seed: int,
    pace: Pace | None = None,
) -> None:
    rng = random.Random(seed)
    pick = rng.randrange
    n = len(resources)
    due = perf_counter() + (pace.offset_s if pace else 0.0)
    while not control.stopping:
        if pace is None:
            started = perf_counter()
        else:
            if (ahead := due - perf_counter()) > 0:
                await asyncio.sleep(ahead)
                if control.stopping:
                    break
            started, due = due, due + pace.interval_s
        resource = resources[pick(n)]
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
