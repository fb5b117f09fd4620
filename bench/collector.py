"""Keep the load generator's own garbage collector out of what it measures.

A collection stops the load generator's event loop; a response that arrives meanwhile waits in its socket
and is counted as the target's latency. With many agents alive, young collections ran dozens of times a
second and a full one took up to ~140 ms (the fleet scenario: 2.3 s of collection in 35 s of
heartbeats; a benchmark cell at W = 64: a full collection of 24 ms). For the measured stretch, the
objects alive at its start are frozen out of collections and the young ones are collected less often;
the same for every target, so no comparison moves.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
