"""``python -m bench``: the options, then one run (see runner.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from bench.config import ALL_TARGETS, RESOURCE_MODES, BenchConfig, quick_config
from bench.http_client import CLIENT_KINDS


def name_list(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (got {text!r})")
        return names

    return parse


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, not {text!r}")
    return values


def positive_int(text: str) -> int:
    values = int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"one positive integer, not {text!r}")
    return values[0]


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"attempts per second, not {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a positive rate, not {text!r}")
    return rate


def parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    defaults = BenchConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Drive W simulated agents (acquire, renew k times, release; on conflict pick again) against "
            "lockledger's HTTP API and its baselines on one PostgreSQL, and report each cell."
        ),
    )
    p.add_argument(
        "--targets",
        type=name_list(ALL_TARGETS),
        default=defaults.targets,
        help=f"comma-separated, from {','.join(ALL_TARGETS)} (default: all)",
    )
    p.add_argument(
        "--workers",
        type=int_list,
        default=defaults.workers,
        help="concurrent agents per cell, comma-separated (default: 1,16,64,256)",
    )
    p.add_argument(
        "--resources-modes",
        dest="modes",
        type=name_list(tuple(RESOURCE_MODES)),
        default=defaults.modes,
        help="uniform (R=100,000) and/or hot (R=8), comma-separated (default: both)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=defaults.duration_s,
        help="measured seconds per cell (default: %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=defaults.warmup_s,
        help="warm-up seconds per cell, not measured (default: %(default)s)",
    )
    p.add_argument("--renews", type=int, default=defaults.renews, help="renews per cycle (default: 0)")
    p.add_argument(
        "--wait-ms",
        type=int,
        default=defaults.wait_ms,
        help="HTTP acquires carry wait_ms: lockledger waits that long for a held lock instead of answering "
        "409 at once (the no-op twin parses it and grants); the baselines still ask once (default: 0)",
    )
    p.add_argument(
        "--rate",
        type=_rate,
        default=defaults.rate,
        help="offer each cell this many attempts per second, spread evenly over its W agents (an open "
        "loop; latency counts from each attempt's scheduled start); default: closed loop, each agent "
        "starts its next cycle when the last one ends",
    )
    p.add_argument(
        "--server-workers",
        type=int_list,
        default=defaults.server_workers,
        help="lockledger server processes; a list runs the HTTP targets once per value (default: 1)",
    )
    p.add_argument(
        "--database-url",
        default=None,
        help="PostgreSQL server to use (a fresh database is created there and dropped after); "
        "default: an embedded PostgreSQL in a temporary directory",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="JSON lines output (default: bench/results/<timestamp>.jsonl)"
    )
    p.add_argument(
        "--http-client",
        choices=("auto", *CLIENT_KINDS),
        default=defaults.http_client,
        help="auto measures both on the no-op endpoint and uses the leaner (default: auto)",
    )
    p.add_argument(
        "--pool-size",
        type=int,
        default=defaults.pool_size,
        help="connections of the raw-sql and eventsourcing baselines (default: %(default)s, "
        "the server's pool size)",
    )
    p.add_argument("--redis-url", default=defaults.redis_url, help="default: %(default)s")
    p.add_argument("--seed", type=int, default=defaults.seed, help="agents' random seed (default: 1)")
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=defaults.repeat,
        help="run every cell K times, interleaved across targets, and report each cell's median run "
        "(default: 1)",
    )
    p.add_argument("--quick", action="store_true", help="smoke mode: W=4, 2 s cells, both resource modes")
    return p  # fmt: skip


def config_from_args(argv: list[str] | None = None, prog: str = "python -m bench") -> BenchConfig:
    args = parser(prog).parse_args(argv)
    config = BenchConfig(
        targets=args.targets,
        workers=args.workers,
        modes=args.modes,
        duration_s=args.duration,
        warmup_s=args.warmup,
        renews=args.renews,
        wait_ms=args.wait_ms,
        rate=args.rate,
        server_workers=args.server_workers,
        database_url=args.database_url,
        out=args.out,
        http_client=args.http_client,
        pool_size=args.pool_size,
        redis_url=args.redis_url,
        seed=args.seed,
        repeat=args.repeat,
    )
    if not 0 <= config.wait_ms < config.request_timeout_s * 1000:
        parser(prog).error(
            f"--wait-ms must be in [0, {config.request_timeout_s * 1000:.0f}), the request timeout"
        )
    if args.quick:
        config = quick_config(config)
    return replace(config, targets=tuple(t for t in ALL_TARGETS if t in config.targets))


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> int:
    config = config_from_args(argv, prog)
    from bench.report import print_report
    from bench.runner import run

    progress = Console(stderr=True)
    path, cells, summary = run(config, progress)
    stdout = Console() if sys.stdout.isatty() else Console(width=240)
    print_report(stdout, cells, summary, config.renews)
    stdout.print(f"results: {path}", highlight=False)
    return 1 if summary["errors"] or summary["violations"] else 0
