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

The youngest generation is scanned once 50,000 more objects are alive than at its last scan, not 700.
That count is allocations minus deallocations since the last scan, but it never falls below zero: what
it measures is how far the live objects have risen above their lowest point since that scan. Under load
the live objects of the requests in flight swing up and down as batches of them finish and their
successors arrive, and once a swing reaches the threshold every swing triggers a scan that walks them
all and frees nothing. At 700 that happened over a hundred times a second at W = 64 (about 7 % of the
server's CPU); at 10,000 it happened again at W = 256: 106 scans in 8 s, 8.8 % of the server's CPU, and
the throughput fell below W = 64's. At 50,000 a scan comes only when long-lived objects (remembered lock
states, tokens) have really accumulated: once in 30 s at W = 256 (33 ms on a slow day of the VM).
Cycles are still reclaimed, only later, and at most about 50,000 objects wait for it.
"""

from __future__ import annotations

import gc

# Net new objects between two scans of the youngest generation (CPython's default is 700).
YOUNG_GENERATION_AFTER = 50_000
# Scans of the middle generation between two scans of the oldest (CPython's default is 10).
OLDEST_GENERATION_EVERY = 1_000


def tune_after_startup() -> None:
    """Call once the app is built and connected: everything alive now lives as long as the process."""
    gc.collect()
    gc.freeze()
    _, middle, _ = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_AFTER, middle, OLDEST_GENERATION_EVERY)
