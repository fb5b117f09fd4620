"""lockledger against each baseline, cell by cell, and the performance goals at W = 64, R = 100,000."""

from __future__ import annotations

from typing import Any

Cell = dict[str, Any]

# The performance goals at W = 64 in the uniform mode (docs/performance.md).
GOAL_WORKERS = 64
GOAL_MODE = "uniform"
MIN_VS_EVENTSOURCING_X = 5.0
MIN_VS_RAW_SQL_PCT = 25.0
MIN_VS_NOOP_PCT = 60.0
MAX_ACQUIRE_P99_MS = 15.0
MAX_SERVER_RSS_MB = 200.0
# An open-loop run (--rate): a target that answers fewer attempts than this share of the offered rate has
# fallen behind its schedule, and its latencies then grow with the length of the window.
MIN_KEPT_UP_PCT = 95.0


def cell_key(cell: Cell) -> tuple[str, str, int, int | None]:
    return cell["target"], cell["mode"], cell["workers"], cell["server_workers"]


def _index(cells: list[Cell]) -> dict[tuple[str, str, int, int | None], Cell]:
    return {cell_key(c): c for c in cells}


def _ratio(a: float | None, b: float | None, scale: float = 1.0) -> float | None:
    if a is None or not b:
        return None
    return round(a / b * scale, 2)


def compute_ratios(cells: list[Cell]) -> list[dict[str, Any]]:
    """One row per lockledger cell: its cycles/s against each baseline's cell of the same mode and W."""
    index = _index(cells)
    rows = []
    for cell in cells:
        if cell["target"] != "lockledger":
            continue
        mode, workers, sw = cell["mode"], cell["workers"], cell["server_workers"]

        def other(name: str, server_workers: int | None = None) -> float | None:
            found = index.get((name, mode, workers, server_workers))  # noqa: B023
            return found["cycles_per_s"] if found else None

        rate = cell["cycles_per_s"]
        row: dict[str, Any] = {
            "mode": mode,
            "workers": workers,
            "server_workers": sw,
            "lockledger_cycles_per_s": rate,
            "vs_eventsourcing_x": _ratio(rate, other("eventsourcing")),
            "vs_raw_sql_pct": _ratio(rate, other("raw-sql"), 100),
            "vs_noop_pct": _ratio(rate, other("noop", sw), 100),
            "vs_redis_pct": _ratio(rate, other("redis"), 100),
        }
        if workers == 256 and (base := index.get(("lockledger", mode, 64, sw))):
            row["w256_vs_w64_pct"] = _ratio(rate, base["cycles_per_s"], 100)
        rows.append(row)
    return rows


def _check(name: str, value: Any, goal: str, ok: bool | None) -> dict[str, Any]:
    return {"check": name, "value": value, "goal": goal, "ok": ok}


def _at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def _below(value: float | None, goal: float) -> bool | None:
    return None if value is None else value < goal


def _throughput_checks(tag: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    es, raw, noop = row["vs_eventsourcing_x"], row["vs_raw_sql_pct"], row["vs_noop_pct"]
    return [
        _check(
            tag + "vs eventsourcing",
            es,
            f">= {MIN_VS_EVENTSOURCING_X}x",
            _at_least(es, MIN_VS_EVENTSOURCING_X),
        ),
        _check(tag + "vs raw-sql", raw, f">= {MIN_VS_RAW_SQL_PCT}%", _at_least(raw, MIN_VS_RAW_SQL_PCT)),
        _check(tag + "vs noop", noop, f">= {MIN_VS_NOOP_PCT}%", _at_least(noop, MIN_VS_NOOP_PCT)),
    ]


def answered_pct(cell: Cell, offered: float) -> float | None:
    """An open-loop cell's attempts answered (granted or refused), as a share of those offered."""
    return _ratio(cell["cycles_per_s"] + cell["conflicts_per_s"], offered, 100)


def _kept_up_check(tag: str, cell: Cell, offered: float) -> dict[str, Any]:
    """With a fixed offered rate (--rate) every target that keeps up does the same cycles/s, so the
    throughput ratios say nothing; what matters is whether lockledger kept up, and its latency then."""
    kept_up = answered_pct(cell, offered)
    return _check(
        tag + f"attempts answered of {offered:g}/s offered",
        kept_up,
        f">= {MIN_KEPT_UP_PCT}%",
        _at_least(kept_up, MIN_KEPT_UP_PCT),
    )


def check_goals(
    cells: list[Cell], ratios: list[dict[str, Any]], every_run: list[Cell] | None = None
) -> list[dict[str, Any]]:
    """The performance goals, for each server-worker count measured; ``ok`` None when not measured.

    ``cells`` holds one cell per (target, mode, W, server workers) (the median run with ``--repeat``);
    memory, errors and violations count over ``every_run`` (default: ``cells``), so no run hides one.
    """
    index = _index(cells)
    runs = cells if every_run is None else every_run
    checks: list[dict[str, Any]] = []
    for sw in sorted({c["server_workers"] for c in cells if c["target"] == "lockledger"}):
        tag = f"server workers {sw}: "
        row = next(
            (r for r in ratios if (r["mode"], r["workers"], r["server_workers"]) == (GOAL_MODE, 64, sw)),
            None,
        )
        cell = index.get(("lockledger", GOAL_MODE, GOAL_WORKERS, sw))
        if row is None or cell is None:
            continue
        offered = cell.get("offered_per_s")
        if offered is None:
            checks.extend(_throughput_checks(tag, row))
        else:
            checks.append(_kept_up_check(tag, cell, offered))
        at = "" if offered is None else f" at {offered:g}/s offered"
        p99 = cell["latency_ms"]["acquire"]["p99"]
        checks.append(
            _check(
                tag + f"acquire p99 ms{at}", p99, f"< {MAX_ACQUIRE_P99_MS}", _below(p99, MAX_ACQUIRE_P99_MS)
            )
        )
        rss = max((c["server_peak_rss_mb"] or 0) for c in runs if c["server_workers"] == sw)
        checks.append(
            _check(tag + "server peak RSS MB", rss, f"< {MAX_SERVER_RSS_MB}", rss < MAX_SERVER_RSS_MB)
        )
        big = index.get(("lockledger", GOAL_MODE, 256, sw))
        if big is not None:
            if offered is None:  # at one offered rate W = 256 does what W = 64 does, when both keep up
                w256 = _ratio(big["cycles_per_s"], cell["cycles_per_s"], 100)
                checks.append(_check(tag + "W=256 vs W=64", w256, ">= 100%", _at_least(w256, 100.0)))
            big_errors = sum(c["errors"] for c in runs if cell_key(c) == cell_key(big))
            checks.append(_check(tag + "W=256 errors", big_errors, "0", big_errors == 0))
        hot = [
            c
            for c in runs
            if c["target"] == "lockledger" and c["mode"] == "hot" and c["server_workers"] == sw
        ]
        if hot:
            errors = sum(c["errors"] for c in hot)
            violations = sum(c["violations"] or 0 for c in hot)
            checks.append(_check(tag + "hot errors", errors, "0", errors == 0))
            checks.append(_check(tag + "hot violations", violations, "0", violations == 0))
    return checks
