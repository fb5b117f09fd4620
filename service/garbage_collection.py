"""Keep Python's cyclic garbage collector from pausing the command path.

A server that remembers lock states and tokens accumulates long-lived objects steadily, and full scans
of the oldest generation then stall every request in flight. Almost nothing on the command path is
cyclic garbage (reference counting frees it when a request ends), so the objects that exist once the app
has started are frozen out of every scan, the oldest generation is scanned a hundred times less often,
and the youngest once 50,000 more objects are alive rather than 700. Cycles are still reclaimed, later.
Why and what it measured: docs/decisions/0009-garbage-collector-tuning.md.
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
