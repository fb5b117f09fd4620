"""Percentiles of latency samples."""

from __future__ import annotations

import math
from collections.abc import Iterable

PERCENTILES = (50, 95, 99)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize_ms(seconds: list[float]) -> dict[str, float | int | None]:
    """``{"n", "p50", "p95", "p99", "mean"}`` in milliseconds; percentiles are None without samples."""
    values = sorted(seconds)
    summary: dict[str, float | int | None] = {"n": len(values)}
    for q in PERCENTILES:
        summary[f"p{q}"] = round(percentile(values, q) * 1e3, 3) if values else None
    summary["mean"] = round(sum(values) / len(values) * 1e3, 3) if values else None
    return summary


def latency_ms(seconds: Iterable[float]) -> dict[str, float | int | None]:
    """``{"count", "p50_ms", "p95_ms", "p99_ms", "max_ms"}``, rounded to 0.01 ms; None without samples."""
    values = sorted(seconds)
    summary: dict[str, float | int | None] = {"count": len(values)}
    for q in PERCENTILES:
        summary[f"p{q}_ms"] = round(percentile(values, q) * 1e3, 2) if values else None
    summary["max_ms"] = round(values[-1] * 1e3, 2) if values else None
    return summary
