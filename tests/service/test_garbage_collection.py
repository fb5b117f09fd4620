"""The collector tuning that keeps full scans off the command path (service/garbage_collection.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from service import garbage_collection


class _Node:
    """Something a weak reference can watch."""

    other: object = None


@pytest.fixture
def tuned() -> Iterator[tuple[int, int, int]]:
    """The collector tuned as at startup from CPython's usual thresholds (an app started earlier in this
    process, e.g. by another test, tuned it already); the process's own restored afterwards."""
    own = gc.get_threshold()
    before = (700, 10, 10)
    gc.set_threshold(*before)
    try:
        garbage_collection.tune_after_startup()
        yield before
    finally:
        gc.unfreeze()
        gc.set_threshold(*own)


def test_startup_objects_are_frozen_and_both_ends_of_the_generations_are_scanned_rarely(
    tuned: tuple[int, int, int],
) -> None:
    before = tuned
    assert gc.get_freeze_count() > 0
    young, middle, oldest = gc.get_threshold()
    assert young == garbage_collection.YOUNG_GENERATION_AFTER > before[0]
    assert middle == before[1]
    assert oldest == garbage_collection.OLDEST_GENERATION_EVERY
    # Cycles created afterwards are still reclaimed by the young generations.
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect(0) >= 1


@pytest.mark.usefixtures("tuned")
def test_cycles_are_still_reclaimed_without_anyone_asking() -> None:
    node = _Node()
    node.other = node
    watched = weakref.ref(node)
    del node
    # Garbage cycles made afterwards push the young generation past its threshold; its scans (and the
    # middle generation's, in case the node was promoted) must find the node on their own.
    made = 0
    while watched() is not None and made < 12 * garbage_collection.YOUNG_GENERATION_AFTER:
        garbage: list[object] = []
        garbage.append(garbage)
        made += 1
    assert watched() is None
    assert made > 0


@pytest.mark.usefixtures("tuned")
def test_requests_in_flight_swinging_up_and_down_do_not_trigger_scans() -> None:
    """The collector counts how far the live objects rose above their lowest point since its last scan.
    256 requests of forty objects each (the benchmark's W = 256) that all finish and are all replaced,
    twenty times over, swing that far every time and leave nothing to collect: no scan may come of it.
    With the previous threshold of 10,000 every swing triggered one."""
    requests, objects_each, swings = 256, 40, 20
    scans: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            scans.append(info["generation"])

    def arrive() -> list[list[list[int]]]:
        return [[[index] for index in range(objects_each)] for _ in range(requests)]

    in_flight = arrive()
    gc.collect()  # counting starts from zero, as right after a scan
    gc.callbacks.append(count)
    try:
        for _ in range(swings):
            in_flight.clear()  # a burst of requests finishes...
            in_flight.extend(arrive())  # ...and as many arrive
    finally:
        gc.callbacks.remove(count)
    assert len(in_flight) == requests
    assert scans == []
