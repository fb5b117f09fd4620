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

The youngest generation is scanned once 10,000 more objects are alive than at its last scan, not 700.
With 64 requests in flight, 700 was reached over a hundred times a second by objects that were about to
be freed anyway, and each scan walked every request's live objects: about 7 % of the server's CPU at
W = 64. At 10,000, a benchmark cell of 25,000 commands triggers two scans. Cycles are still reclaimed,
only later, and at most about 10,000 objects wait for it.
"""

from __future__ import annotations

import gc

# Net new objects between two scans of the youngest generation (CPython's default is 700).
YOUNG_GENERATION_AFTER = 10_000
# Scans of the middle generation between two scans of the oldest (CPython's default is 10).
OLDEST_GENERATION_EVERY = 1_000


def tune_after_startup() -> None:
    """Call once the app is built and connected: everything alive now lives as long as the process."""
    gc.collect()
    gc.freeze()
    _, middle, _ = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_AFTER, middle, OLDEST_GENERATION_EVERY)
