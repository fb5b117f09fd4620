"""What one benchmark run measures: the grid of cells and how each cell is driven."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

ALL_TARGETS = ("lockledger", "noop", "raw-sql", "eventsourcing", "redis")
HTTP_TARGETS = frozenset({"lockledger", "noop"})

# R for each resource mode: a large fleet of pallets, or a handful of contended zones.
RESOURCE_MODES = {"uniform": 100_000, "hot": 8}


@dataclass(frozen=True)
class BenchConfig:
    targets: tuple[str, ...] = ALL_TARGETS
    workers: tuple[int, ...] = (1, 16, 64, 256)
    modes: tuple[str, ...] = ("uniform", "hot")
    duration_s: float = 10.0
    warmup_s: float = 1.5
    renews: int = 0
    ttl_ms: int = 30_000
    wait_ms: int = 0  # lockledger's acquires wait this long for a held lock (the server's wait_ms)
    rate: float | None = None  # attempts per second offered to each cell (an open loop); None: closed
    server_workers: tuple[int, ...] = (1,)
    database_url: str | None = None
    out: Path | None = None
    http_client: str = "auto"  # auto | aiohttp | httptools
    pool_size: int = 16  # connections of the in-process baselines (the server's default pool size)
    request_timeout_s: float = 10.0
    drain_timeout_s: float = 15.0
    redis_url: str = "redis://127.0.0.1:6379/0"
    seed: int = 1
    repeat: int = 1  # runs of every cell, interleaved; the median run stands for the cell (repeats.py)
    quick: bool = False

    def resources(self, mode: str) -> int:
        return RESOURCE_MODES[mode]


def quick_config(base: BenchConfig) -> BenchConfig:
    """The smoke mode: W=4, 2 s cells, both resource modes."""
    return replace(
        base,
        workers=(4,),
        modes=("uniform", "hot"),
        duration_s=min(base.duration_s, 2.0),
        warmup_s=min(base.warmup_s, 0.5),
        quick=True,
    )
