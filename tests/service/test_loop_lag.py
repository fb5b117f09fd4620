"""The loop-lag watcher sees the time a blocked event loop keeps ready work waiting."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import CollectorRegistry, Histogram

from service import loop_lag


def _lag() -> tuple[Histogram, CollectorRegistry]:
    registry = CollectorRegistry()
    return Histogram("lag_seconds", "test", buckets=(0.001, 0.01, 0.1, 1.0), registry=registry), registry


async def _watched(blocking_s: float) -> tuple[float, float, float]:
    """Observations, their sum and the largest bucket below any observation, over one blocking spell."""
    lag, registry = _lag()
    watcher = asyncio.create_task(loop_lag.watch(interval_s=0.01, lag=lag))
    await asyncio.sleep(0.05)  # a few quiet wake-ups
    time.sleep(blocking_s)  # noqa: ASYNC251  (on purpose: what a CPU-bound burst does to the loop)
    await asyncio.sleep(0.05)
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    return value("lag_seconds_count"), value("lag_seconds_sum"), value("lag_seconds_bucket", le="0.01")


async def test_a_blocked_loop_shows_as_lag() -> None:
    count, total, up_to_10ms = await _watched(0.08)
    assert count >= 5
    # The wake-up due during the 80 ms block came at least 70 ms late: one observation above 10 ms.
    assert total >= 0.06
    assert up_to_10ms <= count - 1
