"""``--rate``: agents attempt on a fixed schedule (an open loop) instead of as fast as answers come back,
and an acquire's latency counts from its scheduled start, so a target that falls behind shows it."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from time import perf_counter
from typing import Any

import pytest
from rich.console import Console

from bench.cli import config_from_args
from bench.config import BenchConfig
from bench.ratios import check_goals, compute_ratios
from bench.recorder import Recorder
from bench.runner import run
from bench.workload import Control, Pace, run_agent


class _Agent:
    """A target that takes ``service_s`` per acquire (one at a time, like one server) and records when
    each acquire was sent."""

    def __init__(self, service_s: float, server: asyncio.Lock) -> None:
        self.service_s = service_s
        self.server = server
        self.sent: list[float] = []
        self.tokens = 0

    async def acquire(self, resource: str) -> Any | None:
        self.sent.append(perf_counter())
        async with self.server:
            await asyncio.sleep(self.service_s)
        self.tokens += 1
        return self.tokens

    async def renew(self, resource: str, token: Any) -> None:
        return None

    async def release(self, resource: str, token: Any) -> None:
        return None


async def _drive(
    workers: int, seconds: float, service_s: float, rate: float | None
) -> tuple[Recorder, list[float]]:
    recorder = Recorder(active=True)
    control = Control()
    server = asyncio.Lock()
    agents = [_Agent(service_s, server) for _ in range(workers)]
    tasks = [
        asyncio.create_task(
            run_agent(
                agent,
                ["r"],
                0,
                recorder,
                control,
                seed=i,
                pace=None if rate is None else Pace.spread(rate, workers, i),
            )
        )
        for i, agent in enumerate(agents)
    ]
    await asyncio.sleep(seconds)
    control.stopping = True
    await asyncio.gather(*tasks)
    return recorder, sorted(t for agent in agents for t in agent.sent)


def test_agents_share_the_rate_as_one_even_stream() -> None:
    """The agents' schedules interleave into one stream at the rate, staggered rather than in bursts."""
    rate, workers = 200.0, 4
    paces = [Pace.spread(rate, workers, i) for i in range(workers)]
    schedule = sorted(p.offset_s + k * p.interval_s for p in paces for k in range(50))
    gaps = [b - a for a, b in itertools.pairwise(schedule)]
    assert gaps == pytest.approx([1 / rate] * len(gaps))


def test_no_attempt_is_sent_ahead_of_its_schedule() -> None:
    """A slow machine can only send later than planned, never more than the rate allows."""
    recorder, sent = asyncio.run(_drive(workers=4, seconds=1.0, service_s=0.0, rate=200))
    assert 0 < recorder.cycles <= 200 + 4
    assert len(sent) <= 200 + 4


def test_a_target_that_falls_behind_shows_the_wait_in_its_latency() -> None:
    """A server of 20 ms per acquire offered 100 per second (it can do 50): in a closed loop each
    acquire takes what its queue makes it, at most 4 x 20 ms; in the open loop the schedule runs away
    from it, and the latency counted from the schedule grows with the window."""
    closed, _ = asyncio.run(_drive(workers=4, seconds=1.0, service_s=0.02, rate=None))
    opened, _ = asyncio.run(_drive(workers=4, seconds=1.0, service_s=0.02, rate=100))
    assert max(opened.latencies["acquire"]) > 0.3
    assert max(opened.latencies["acquire"]) > 2 * max(closed.latencies["acquire"])
    assert opened.cycles <= 55


def test_an_open_loop_run_checks_keeping_up_and_latency_not_throughput_ratios() -> None:
    def cell(target: str, cycles: float) -> dict[str, Any]:
        return {
            "target": target,
            "mode": "uniform",
            "workers": 64,
            "server_workers": 1 if target in ("lockledger", "noop") else None,
            "offered_per_s": 500.0,
            "cycles_per_s": cycles,
            "conflicts_per_s": 0.0,
            "errors": 0,
            "violations": None,
            "server_peak_rss_mb": 90.0 if target in ("lockledger", "noop") else None,
            "latency_ms": {"acquire": {"p99": 6.5}},
        }

    cells = [cell("lockledger", 470.0), cell("noop", 500.0)]
    checks = {c["check"]: c for c in check_goals(cells, compute_ratios(cells))}
    assert not any("vs noop" in name for name in checks)
    kept = checks["server workers 1: attempts answered of 500/s offered"]
    assert kept["value"] == 94.0
    assert kept["ok"] is False
    assert checks["server workers 1: acquire p99 ms at 500/s offered"]["ok"] is True


def test_the_rate_must_be_positive() -> None:
    assert config_from_args(["--rate", "750"]).rate == 750.0
    assert config_from_args([]).rate is None
    for bad in ("0", "-5", "fast"):
        with pytest.raises(SystemExit):
            config_from_args(["--rate", bad])


@pytest.mark.storage
@pytest.mark.slow
def test_lockledger_keeps_an_offered_rate(database_url: str, tmp_path: Path) -> None:
    """Through the real server: 8 agents offered 100 attempts per second together do about 100."""
    config = BenchConfig(
        targets=("lockledger",),
        workers=(8,),
        modes=("uniform",),
        database_url=database_url,
        out=tmp_path / "bench.jsonl",
        duration_s=1.5,
        warmup_s=0.3,
        rate=100.0,
    )
    _path, cells, summary = run(config, Console(stderr=True, quiet=True))
    (cell,) = cells
    assert cell["offered_per_s"] == 100.0
    assert any(
        note.startswith("open loop: every cell was offered 100 attempts/s") for note in summary["notes"]
    )
    assert cell["errors"] == 0, cell["error_samples"]
    assert 85 <= cell["cycles_per_s"] + cell["conflicts_per_s"] <= 105
