"""The hot mode's safety check finds overlapping holds and fencing-token regressions, and nothing else."""

from __future__ import annotations

from bench.safety import Grant, check_grants
from bench.stats import percentile, summarize_ms


def test_serialized_grants_pass() -> None:
    grants = [
        Grant("r", 1, 0.0, 1.0),
        Grant("r", 2, 1.5, 2.0),
        Grant("s", 1, 0.5, 3.0),
        Grant("r", 3, 2.1, 2.2),
    ]
    report = check_grants(grants, monotonic_tokens=True)
    assert report.grants == 4
    assert report.violations == 0


def test_a_grant_before_the_previous_release_is_an_overlap() -> None:
    report = check_grants([Grant("r", 1, 0.0, 1.0), Grant("r", 2, 0.9, 2.0)], monotonic_tokens=True)
    assert report.overlaps == 1
    assert report.token_regressions == 0
    assert "r: token 2 granted" in report.examples[0]


def test_an_overlap_with_a_long_earlier_hold_is_found() -> None:
    grants = [Grant("r", 1, 0.0, 10.0), Grant("r", 2, 1.0, 11.0), Grant("r", 3, 12.0, 13.0)]
    assert check_grants(grants, monotonic_tokens=True).overlaps == 1
    long_hold = [Grant("r", 1, 0.0, 10.0), Grant("r", 2, 11.0, 11.5), Grant("r", 3, 5.0, 5.5)]
    assert check_grants(long_hold, monotonic_tokens=True).overlaps == 1


def test_a_lower_or_equal_token_is_a_regression_unless_tokens_are_unordered() -> None:
    grants = [Grant("r", 5, 0.0, 1.0), Grant("r", 5, 2.0, 3.0), Grant("r", 4, 4.0, 5.0)]
    assert check_grants(grants, monotonic_tokens=True).token_regressions == 2
    assert check_grants(grants, monotonic_tokens=False).violations == 0


def test_percentiles_are_nearest_rank_in_milliseconds() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert percentile(values, 50) == 0.05
    summary = summarize_ms(values)
    assert summary["n"] == 100
    assert summary["p99"] == 99.0
    assert summarize_ms([])["p50"] is None
