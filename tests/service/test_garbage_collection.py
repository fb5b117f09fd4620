"""The collector tuning that keeps full scans off the command path (service/garbage_collection.py)."""

from __future__ import annotations

import gc

from service import garbage_collection


def test_startup_objects_are_frozen_and_the_oldest_generation_is_scanned_rarely() -> None:
    before = gc.get_threshold()
    try:
        garbage_collection.tune_after_startup()
        assert gc.get_freeze_count() > 0
        young, middle, oldest = gc.get_threshold()
        assert (young, middle) == before[:2]
        assert oldest == garbage_collection.OLDEST_GENERATION_EVERY
        # Cycles created afterwards are still reclaimed by the young generations.
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect(0) >= 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
