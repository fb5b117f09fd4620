"""The fleet run's report on stdout: the environment in one line, then per scenario a table of its
measures against their targets (``bench.report.goals_table``), read from the JSON records."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console

from bench.fleet_config import OTHER_LOAD_WARNING_PCT
from bench.report import goals_table

Row = dict[str, Any]  # check, value, goal, ok (None: a measure without a target)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    elif isinstance(value, int):
        text = f"{value:,}"
    else:
        text = str(value)
    return text + unit


def _row(check: str, value: str, goal: str = "", ok: bool | None = None) -> Row:
    return {"check": check, "value": value, "goal": goal, "ok": ok}


def _latencies(summary: dict[str, Any], keys: tuple[str, ...], unit: str) -> str:
    return " / ".join(_fmt(summary[key]) for key in keys) + unit


def _resources_rows(label: str, resources: dict[str, Any]) -> list[Row]:
    server = resources.get("server", {})
    per_process = ", ".join(map(str, server.get("process_cpu_pct", [])))
    rows = [
        _row(
            f"{label}: server CPU (per process) / peak RSS (tree, largest process)",
            f"{_fmt(server.get('cpu_pct'), ' %')} ({per_process}) / "
            f"{_fmt(server.get('peak_rss_mb'), ' MB')}, {_fmt(server.get('peak_process_rss_mb'), ' MB')}",
        )
    ]
    others = [
        f"{name} {_fmt(resources[name].get('cpu_pct'), ' %')}"
        for name in ("postgres", "client")
        if name in resources
    ]
    other_pct = resources.get("other_cpu_pct")
    if other_pct is not None:
        others.append(f"rest of machine {_fmt(other_pct, ' %')}")
    rows.append(_row(f"{label}: CPU elsewhere (100 % = 1 core)", ", ".join(others)))
    if (other_pct or 0) > OTHER_LOAD_WARNING_PCT:
        rows.append(
            _row(
                f"{label}: other processes used {other_pct} % of a core",
                "figures disturbed; rerun on a quiet machine",
            )
        )
    return rows


def heartbeats_rows(record: dict[str, Any]) -> list[Row]:
    renew, acquire, checks = record["renew"], record["acquire"], record["checks"]
    rows = [
        _row(
            "API tokens minted (one per agent; authentication on)",
            f"{record['tokens']['minted']:,} in {record['tokens']['seconds']} s",
        ),
        _row(
            "acquired",
            f"{acquire['held']:,} in {acquire['seconds']} s ({_fmt(acquire['per_s'])}/s)",
            "all",
            checks["all_acquired"],
        ),
        _row(
            "renews/s achieved",
            f"{_fmt(renew['achieved_per_s'])} ({renew['ok']:,} renews)",
            _fmt(renew["target_per_s"]),
            renew["achieved_per_s"] >= 0.95 * renew["target_per_s"],
        ),
        _row(
            "renew latency p50 / p95 / p99 / max",
            _latencies(renew["latency_ok"], ("p50_ms", "p95_ms", "p99_ms", "max_ms"), " ms"),
        ),
        _row("renew statuses", json.dumps(renew["statuses"]), "all 200", checks["every_renew_200"]),
        _row("lost leases (409/410)", _fmt(renew["lost_leases"]), "0", checks["no_lost_lease"]),
        _row(
            "spurious expiries (LOCK_EXPIRED in the log)",
            _fmt(record["spurious_expiries"]),
            "0",
            checks["no_spurious_expiry"],
        ),
    ]
    if renew["lost_leases"] or renew["renews_sent_after_deadline"]:
        rows.append(
            _row(
                "  lost with renew sent before the deadline / renews sent after it",
                f"{renew['lost_sent_before_deadline']:,} / {renew['renews_sent_after_deadline']:,}",
            )
        )
    rows += [
        _row(
            "expiries recorded before their deadline",
            _fmt(record["expiries_before_deadline"]),
            "0",
            checks["no_expiry_before_deadline"],
        ),
        _row(
            "client: renew send lag p99 / max; event-loop lag p99 / max",
            f"{_fmt(renew['send_lag_p99_ms'])} / {_fmt(renew['send_lag_max_ms'])} ms; "
            + _latencies(renew["client_loop_lag"], ("p99_ms", "max_ms"), " ms"),
        ),
        *_resources_rows("renew phase", renew["resources"]),
        _row("release statuses", json.dumps(record["release"]["statuses"])),
    ]
    return rows


def lapse_rows(record: dict[str, Any]) -> list[Row]:
    create, expiry, probe, checks = record["create"], record["expiry"], record["probe"], record["checks"]
    rows = [
        _row(
            "API tokens minted (creation slots + probe; authentication on)",
            f"{record['tokens']['minted']:,} in {record['tokens']['seconds']} s",
        ),
        _row(
            "created",
            f"{create['created']:,} in {create['seconds']} s ({_fmt(create['per_s'])}/s)",
            "all",
            checks["all_created"],
        ),
        _row(
            "first deadline after creation / deadline spread",
            f"{record['deadlines']['first_after_creation_s']} s / {record['deadlines']['spread_s']} s",
            "> 0 s",
            checks["lapsed_after_creation"],
        ),
        _row(
            "expired (by the reaper) / still held",
            f"{expiry['expired']:,} ({expiry['by_reaper']:,}) / {expiry['still_held']:,}",
            "all / 0",
            checks["all_expired"],
        ),
        _row(
            "lateness p50 / p95 / p99 / max",
            _latencies(expiry, ("p50_s", "p95_s", "p99_s", "max_s"), " s"),
            "p99 < 1 s",
            checks["lateness_p99_under_1s"],
        ),
        _row(
            "expired > 10 s / > 1 s after deadline",
            f"{expiry['over_10s']:,} / {expiry['over_1s']:,}",
            "0 / -",
            checks["none_later_than_10s"],
        ),
        _row("last deadline -> last expiry", _fmt(expiry["last_deadline_to_last_expiry_s"], " s")),
        _row(
            "reaper rate mean / peak (expiries/s)",
            _latencies(expiry, ("mean_rate_per_s", "peak_rate_per_s"), ""),
        ),
    ]
    for label, key in (
        ("probe, idle", "baseline"),
        ("probe, creation", "during_creation"),
        ("probe, lapse window", "during_lapse"),
    ):
        window = probe[key]
        lapse_window = key == "during_lapse"
        rows.append(
            _row(
                f"{label}: cycles/s, p50 / p99, errors",
                f"{_fmt(window['cycles_per_s'])}, "
                f"{_latencies(window['latency'], ('p50_ms', 'p99_ms'), ' ms')}, {window['errors']}",
                "0 errors" if lapse_window else "",
                checks["probe_no_errors"] if lapse_window else None,
            )
        )
    return (
        rows
        + _resources_rows("creation", create["resources"])
        + _resources_rows("lapse window", expiry["resources"])
    )


def heartbeats_title(record: dict[str, Any]) -> str:
    p = record["params"]
    return (
        f"heartbeats: {p['agents']:,} agents, renew every {p['interval_s']:g} s "
        f"for {p['duration_s']:g} s, ttl {p['ttl_ms']:,} ms"
    )


def lapse_title(record: dict[str, Any]) -> str:
    p = record["params"]
    ttl = f"ttl {record['ttl_ms']:,} ms" if record["ttl_ms"] else "deadlines clustered"
    return f"lapse: {p['leases']:,} leases ({p['deadlines']}, {ttl}), probe {p['probe_agents']} agents"


def environment_line(record: dict[str, Any]) -> str:
    return (
        f"{record['cpu_count']} CPUs, {record['memory_gb']} GB, Python {record['python']}, "
        f"PostgreSQL {record['postgresql']} ({record['postgresql_settings']}), "
        f"{record['server_workers']} server workers, auth {record.get('auth')}, "
        f"reaper {record['reaper_interval_ms']} ms / {record['reaper_batch_size']}, "
        f"git {record['git_commit']}, "
        f"client loop {record['event_loop']}"
    )


def print_report(records: list[dict[str, Any]], console: Console) -> None:
    for record in records:
        if record["kind"] == "environment":
            console.print(environment_line(record))
        elif record["kind"] == "heartbeats":
            console.print(goals_table(heartbeats_rows(record), title=heartbeats_title(record)))
        elif record["kind"] == "lapse":
            console.print(goals_table(lapse_rows(record), title=lapse_title(record)))
