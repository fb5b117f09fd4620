"""``python -m bench.reservations`` at a tiny size: both modes take routes, and the summary compares them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.reservations import RESERVATION, SINGLES, main

pytestmark = [pytest.mark.storage, pytest.mark.slow]


def test_routes_are_taken_both_ways_and_compared(database_url: str, tmp_path: Path) -> None:
    out = tmp_path / "reservations.jsonl"
    argv = [
        "--zones",
        "3",
        "--workers",
        "2",
        "--duration",
        "1",
        "--rounds",
        "1",
        "--database-url",
        database_url,
    ]
    assert main([*argv, "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rounds = [r for r in records if r["kind"] == "round"]
    assert sorted(r["mode"] for r in rounds) == sorted([RESERVATION, SINGLES])
    assert all(r["routes"] > 0 for r in rounds)
    (summary,) = [r for r in records if r["kind"] == "summary"]
    ratios = summary["reservation_over_singles"]
    singles = summary["medians"][SINGLES]["routes_per_s"]
    assert ratios["routes_per_s"] == round(summary["medians"][RESERVATION]["routes_per_s"] / singles, 3)
