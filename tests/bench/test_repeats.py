"""``--repeat K``: each cell is represented by its median run, while memory, errors and violations
count over every run, so a bad run is never hidden behind a good median."""

from __future__ import annotations

from typing import Any

import pytest

from bench.cli import config_from_args
from bench.ratios import check_goals, compute_ratios
from bench.repeats import median_cells


def _cell(
    target: str, cycles: float, *, workers: int = 64, mode: str = "uniform", **extra: Any
) -> dict[str, Any]:
    cell: dict[str, Any] = {
        "target": target,
        "mode": mode,
        "workers": workers,
        "server_workers": 1 if target in ("lockledger", "noop") else None,
        "cycles_per_s": cycles,
        "errors": 0,
        "violations": 0 if mode == "hot" else None,
        "server_peak_rss_mb": 90.0 if target in ("lockledger", "noop") else None,
        "latency_ms": {"acquire": {"p99": 30.0}},
    }
    cell.update(extra)
    return cell


def test_the_median_run_stands_for_the_cell_with_every_run_beside_it() -> None:
    runs = [_cell("lockledger", c) for c in (1_700, 1_500, 1_900)] + [
        _cell("noop", c) for c in (3_600, 3_800)
    ]
    chosen = median_cells(runs)
    assert [(c["target"], c["cycles_per_s"]) for c in chosen] == [("lockledger", 1_700), ("noop", 3_600)]
    assert chosen[0]["runs"] == 3
    assert chosen[0]["cycles_per_s_runs"] == [1_500, 1_700, 1_900]
    assert chosen[1]["cycles_per_s_runs"] == [3_600, 3_800]  # even count: the lower middle run
    single = _cell("raw-sql", 2_700)
    assert median_cells([single]) == [single]  # one run: the cell as it was measured, nothing added


def test_ratios_use_the_medians_and_goals_count_every_run() -> None:
    runs = [
        *(_cell("lockledger", c) for c in (1_700, 1_500, 1_900)),
        *(_cell("noop", c) for c in (3_600, 3_400, 3_800)),
        _cell("lockledger", 1_800, workers=256),
        _cell("lockledger", 1_850, workers=256, errors=2),  # the faster run had errors
        _cell("lockledger", 1_750, workers=256, server_peak_rss_mb=150.0),
    ]
    medians = median_cells(runs)
    ratios = compute_ratios(medians)
    w64 = next(r for r in ratios if r["workers"] == 64)
    assert w64["vs_noop_pct"] == pytest.approx(1_700 / 3_600 * 100, abs=0.01)
    goals = {g["check"].split(": ", 1)[1]: g for g in check_goals(medians, ratios, every_run=runs)}
    assert goals["W=256 errors"]["value"] == 2
    assert goals["W=256 errors"]["ok"] is False
    assert goals["server peak RSS MB"]["value"] == 150.0
    assert goals["W=256 vs W=64"]["value"] == pytest.approx(1_800 / 1_700 * 100, abs=0.01)


def test_repeat_is_a_positive_integer_on_the_command_line() -> None:
    assert config_from_args(["--repeat", "3"]).repeat == 3
    assert config_from_args([]).repeat == 1
    for bad in ("0", "two", "2,3"):
        with pytest.raises(SystemExit):
            config_from_args(["--repeat", bad])
