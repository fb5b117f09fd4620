"""Keep Python's cyclic garbage collector from pausing the command path.

The collector's oldest generation is scanned whole once enough objects have survived younger scans. A
server that remembers lock states (``state_cache``) and tokens accumulates long-lived objects steadily,
so under load those full scans came every few seconds and took tens of milliseconds each, with every
request in flight waiting: at 64 agents they were the whole of acquire's p99 (about 90 ms against a
p95 of 34 ms) and cost a fifth of the throughput (docs/performance.md).

Almost nothing on this path is cyclic garbage: the objects it creates are freed by reference counting
as soon as a request ends (a benchmark cell of 25,000 commands left about a thousand objects for the
collector to find). So the objects that exist once the app has started (modules, routes, models, the
pools) are frozen out of every scan, and the oldest generation is scanned a hundred times less often.
The young generations are collected as usual, so cycles are still reclaimed.
"""

from __future__ import annotations

import gc

# Scans of the middle generation between two scans of the oldest (CPython's default is 10).
OLDEST_GENERATION_EVERY = 1_000


def tune_after_startup() -> None:
    """Call once the app is built and connected: everything alive now lives as long as the process."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, OLDEST_GENERATION_EVERY)
