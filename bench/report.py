"""The Rich tables printed at the end of a run: every cell, lockledger's ratios, the performance goals."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.repeats import median_cells

Cell = dict[str, Any]
SHORT = {"server": "srv", "loadgen": "LG", "machine": "box"}


def _num(value: float | int | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _lat(cell: Cell, command: str) -> str:
    lat = cell["latency_ms"][command]
    if not lat["n"]:
        return "-"
    return f"{lat['p50']:.1f}/{lat['p95']:.1f}/{lat['p99']:.1f}"


def _runs(cell: Cell) -> str:
    """Every run's cycles/s, lowest to highest, when the cell was repeated (the median one is shown)."""
    runs = cell.get("cycles_per_s_runs")
    return " ".join(_num(r) for r in runs) if runs else "-"


def cells_table(cells: list[Cell], renews: int, auth: str | None = None) -> Table:
    authenticated = f"; HTTP agents authenticate ({auth}, one API token each)" if auth else ""
    repeated = any("runs" in cell for cell in cells)
    table = Table(
        title=f"python -m bench: every cell (latency ms p50/p95/p99; CPU in % of one core{authenticated})",
        title_justify="left",
    )
    for name, justify in (
        ("target", "left"),
        ("srv w", "right"),
        ("mode", "left"),
        ("W", "right"),
        ("cycles/s", "right"),
        *((("runs: cycles/s", "right"),) if repeated else ()),
        ("confl/s", "right"),
        ("err", "right"),
        ("acquire", "right"),
        *((("renew", "right"),) if renews else ()),
        ("release", "right"),
        ("srv CPU%", "right"),
        ("srv µs/req", "right"),
        ("srv RSS MB", "right"),
        ("PG CPU%", "right"),
        ("LG CPU%", "right"),
        ("LG ms/req", "right"),
        ("other CPU%", "right"),
        ("saturated", "left"),
        ("viol", "right"),
    ):
        table.add_column(name, justify=justify)
    for cell in cells:
        violations = cell["violations"]
        table.add_row(
            cell["target"],
            _num(cell["server_workers"]),
            cell["mode"],
            str(cell["workers"]),
            _num(cell["cycles_per_s"]),
            *((_runs(cell),) if repeated else ()),
            _num(cell["conflicts_per_s"]),
            f"[red]{cell['errors']}[/red]" if cell["errors"] else "0",
            _lat(cell, "acquire"),
            *((_lat(cell, "renew"),) if renews else ()),
            _lat(cell, "release"),
            _num(cell["server_cpu_pct"]),
            _num(cell.get("server_cpu_us_per_request")),
            _num(cell["server_peak_rss_mb"]),
            _num(cell["pg_cpu_pct"] if cell["target"] != "redis" else cell["redis_cpu_pct"]),
            _num(cell["loadgen_cpu_pct"]),
            _num(cell["loadgen_cpu_ms_per_request"], 3),
            _num(cell["other_cpu_pct"]),
            ",".join(SHORT.get(s, s) for s in cell["saturated"]) or "-",
            "-" if violations is None else (f"[red]{violations}[/red]" if violations else "0"),
        )
    return table


def inside_table(cells: list[Cell]) -> Table | None:
    """The server's own view of each window (one-worker lockledger and noop cells), from /metrics."""
    rows = [cell for cell in cells if cell.get("inside_server")]
    if not rows:
        return None
    table = Table(
        title="Inside the server (its /metrics over the window): database round trips and event-loop lag",
        title_justify="left",
    )
    for name in ("target", "mode", "W", "commits/s", "cmds/commit", "commit ms", "reads/s", "cmds/read",
                 "read ms", "loop lag ms mean/p99"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("target", "mode") else "right")
    for cell in rows:
        view = cell["inside_server"]
        columns: list[str] = []
        for kind in ("commit", "load"):
            batches = view[kind]
            if batches is None:
                columns += ["-", "-", "-"]
            else:
                columns += [
                    _num(batches["batches_per_s"]),
                    _num(batches["commands_per_batch"], 1),
                    _num(batches["batch_ms"], 1),
                ]
        lag = view["loop_lag_ms"]
        table.add_row(
            cell["target"],
            cell["mode"],
            str(cell["workers"]),
            *columns,
            "-" if lag is None else f"{lag['mean']:.1f}/{lag['p99']:.1f}",
        )
    return table


def ratios_table(ratios: list[dict[str, Any]]) -> Table:
    table = Table(
        title="lockledger's cycles/s against each baseline (same mode, same W)", title_justify="left"
    )
    for name in ("srv w", "mode", "W", "lockledger", "vs eventsourcing", "vs raw-sql", "vs noop", "vs redis",
                 "W256 vs W64"):  # fmt: skip
        table.add_column(name, justify="left" if name == "mode" else "right")
    for row in ratios:
        table.add_row(
            str(row["server_workers"]),
            row["mode"],
            str(row["workers"]),
            _num(row["lockledger_cycles_per_s"]),
            "-" if row["vs_eventsourcing_x"] is None else f"{row['vs_eventsourcing_x']:.2f}x",
            "-" if row["vs_raw_sql_pct"] is None else f"{row['vs_raw_sql_pct']:.1f}%",
            "-" if row["vs_noop_pct"] is None else f"{row['vs_noop_pct']:.1f}%",
            "-" if row["vs_redis_pct"] is None else f"{row['vs_redis_pct']:.1f}%",
            "-" if row.get("w256_vs_w64_pct") is None else f"{row['w256_vs_w64_pct']:.1f}%",
        )
    return table


GOALS_TITLE = "Performance goals (W = 64, R = 100,000 unless named)"


def goals_table(checks: list[dict[str, Any]], title: str = GOALS_TITLE) -> Table:
    """One row per check: what, its value, its goal, and whether it was met (``ok`` None: no goal)."""
    table = Table(title=title, title_justify="left")
    for name in ("check", "value", "goal", "met"):
        table.add_column(name)
    for check in checks:
        ok = check["ok"]
        met = "-" if ok is None else ("[green]yes[/green]" if ok else "[red]no[/red]")
        table.add_row(escape(check["check"]), str(check["value"]), escape(check["goal"]), met)
    return table


def print_report(console: Console, cells: list[Cell], summary: dict[str, Any], renews: int) -> None:
    """The tables; with ``--repeat`` each cell is its median run (as the ratios and goals are)."""
    cells = median_cells(cells)
    console.print(cells_table(cells, renews, summary["environment"].get("auth")))
    if (inside := inside_table(cells)) is not None:
        console.print(inside)
    if summary["ratios"]:
        console.print(ratios_table(summary["ratios"]))
    if summary["goals"]:
        console.print(goals_table(summary["goals"]))
    for note in summary["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
