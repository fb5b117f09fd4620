"""``python -m bench.fair_queue`` at a tiny size: two servers, a few waiters served in queue order, and a
JSON line with the wake-up quantiles (their values are not judged here: figures come from real runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import fair_queue
from bench.output import read

pytestmark = pytest.mark.storage


def test_the_fair_queue_bench_hands_the_lock_over_in_queue_order(database_url: str, tmp_path: Path) -> None:
    out = tmp_path / "fair-queue.jsonl"
    assert fair_queue.main(["--waiters", "3", "--database-url", database_url, "--out", str(out)]) == 0
    [record] = read(out)
    assert record["kind"] == "fair_queue"
    assert record["waiters"] == 3
    assert record["in_queue_order"] is True
    assert 0 < record["wake_ms_p50"] <= record["wake_ms_p99"] <= record["wake_ms_max"]


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert fair_queue.percentile(values, 0.5) == 50.0
    assert fair_queue.percentile(values, 0.99) == 99.0
    assert fair_queue.percentile([7.0], 0.99) == 7.0
