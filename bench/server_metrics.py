"""What the server says about itself over a cell's window: its database round trips and how late its
event loop ran, read from ``/metrics`` just before and just after the window.

The client sees a request's whole latency; this splits it. ``commands_per_batch`` says whether
coalescing pays, ``batch_ms`` how long a round trip to PostgreSQL takes under this load, and the loop lag
how long ready work waits for the one Python thread (the server's own queue). Each server process keeps
its own counters, so this is read for one-worker servers only.
"""

from __future__ import annotations

import math
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, str], float]  # (sample name, its kind or le label) -> value

BATCH_KINDS = ("commit", "load")
LOOP_LAG = "lockledger_event_loop_lag_seconds"


def scrape(metrics_url: str, timeout_s: float = 5.0) -> Samples:
    """The samples of lockledger's batch and loop-lag histograms, keyed by name and label."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("lockledger_db_batch_size", "lockledger_db_batch_seconds", LOOP_LAG):
            continue
        for sample in family.samples:
            label = sample.labels.get("kind", "")
            if sample.name.endswith("_bucket"):
                if family.name != LOOP_LAG:
                    continue
                label = sample.labels["le"]
            samples[(sample.name, label)] = sample.value
    return samples


def inside(before: Samples, after: Samples, window_s: float) -> dict[str, Any]:
    """The window's figures: per batch kind, batches/s, commands per batch and mean round trip (ms);
    the loop lag's mean and p99 (ms, the p99 interpolated within its histogram bucket)."""

    def delta(name: str, label: str = "") -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)

    figures: dict[str, Any] = {"window_s": round(window_s, 3)}
    for kind in BATCH_KINDS:
        batches = delta("lockledger_db_batch_size_count", kind)
        if batches <= 0:
            figures[kind] = None
            continue
        figures[kind] = {
            "batches_per_s": round(batches / window_s, 1),
            "commands_per_batch": round(delta("lockledger_db_batch_size_sum", kind) / batches, 2),
            "batch_ms": round(delta("lockledger_db_batch_seconds_sum", kind) / batches * 1e3, 2),
        }
    wakeups = delta(f"{LOOP_LAG}_count")
    figures["loop_lag_ms"] = None
    if wakeups > 0:
        buckets = sorted(
            (float(le), delta(f"{LOOP_LAG}_bucket", le))
            for (name, le) in after
            if name == f"{LOOP_LAG}_bucket"
        )
        figures["loop_lag_ms"] = {
            "wakeups": int(wakeups),
            "mean": round(delta(f"{LOOP_LAG}_sum") / wakeups * 1e3, 2),
            "p99": round(bucket_quantile(buckets, 0.99) * 1e3, 2),
        }
    return figures


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a histogram given as ascending (upper bound, cumulative count) pairs, by linear
    interpolation inside the bucket it falls in (as PromQL's ``histogram_quantile``); the last finite
    bound when it falls in the ``+Inf`` bucket."""
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
