"""The replay API at a year's scale: ``python -m bench.history --events 1000000,10000000``.

For each N: a fresh database (the bench's embedded PostgreSQL, or a new database on ``--database-url``)
gets N events of synthetic fleet history (``bench/history_load.py``); then a real lockledger server
(``bench.server``, authentication on) serves it, and an investigator's token asks what a user asks,
one request at a time (the state and history requests after two of each kind, not counted):

- ``state``: the whole fleet at an instant T, ``GET /v1/replay/state?at=T&limit=10000`` following
  ``next_cursor`` to the end; the time of the whole answer, and of its first page. T is the instant of a
  random event, so it falls while the fleet is busy (between the shifts nothing is live). The loader
  built ``holding_periods`` up to the end of the log, so this is the projection's path.
- ``state from the log``: the same instants once more, from a server whose projector is off and with the
  projection's checkpoint covering nothing, so replay falls back to the log (the path of decision 0033).
- ``resource hour``: ``GET /v1/locks/{r}/history?from=&to=``, the hour around a random event of r.
- ``agent hour``: ``GET /v1/agents/{owner}/history?from=&to=``, the hour around a random event of owner.
- ``export``: ``GET /v1/events?from=&to=`` (NDJSON, streamed), the first ``--export-max`` events (the
  whole log when it is shorter: no ``to``), counted line by line as they arrive; events/s, and the peak
  RSS of this client and of the server meanwhile against what they held just before (the export's
  memory must stay flat).
- ``verify``: ``eventstore.verify.verify_chains`` over the whole log, as ``lockledger verify`` runs it.

A table on stdout (each N, the ratio of the largest N's figure to the smallest's, the spec's targets) and
JSON lines in ``bench/results/history-<timestamp>.jsonl``: an environment record, one ``history`` record
per N, then a ``summary`` with the ratios and targets. A failed request is counted (``errors``, the
first message) and left out of the latencies; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
import asyncpg
from rich.console import Console
from rich.table import Table

from bench.auth import AUTH, bearer
from bench.cli import int_list, positive_int
from bench.database import inspect_server, provision
from bench.environment import environment as machine_environment
from bench.fleet_measure import Resources
from bench.history_load import HistoryShape, LoadReport, load_history
from bench.output import RESULTS_DIR, JsonLines, default_path
from bench.runner import run_async
from bench.server import LockledgerServer
from bench.stats import latency_ms
from domain.access import Role
from domain.timestamps import format_timestamp
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import verify_chains
from service import tokens

PAGE = 1000  # the largest page the history endpoints give
STATE_PAGE = 10_000  # the largest page of the state at an instant: a whole fleet in one, as the SDK asks
WARMUP = 2  # requests of each kind before the measured ones
HOUR = timedelta(hours=1)

# The spec's targets (docs/performance.md): (figure, bound, "<" or ">"); the state's at 10 M events.
TARGETS: tuple[tuple[str, float, str], ...] = (
    ("state_p95_ms", 150.0, "<"),
    ("resource_hour_p95_ms", 50.0, "<"),
    ("agent_hour_p95_ms", 100.0, "<"),
    ("export_events_per_s", 100_000.0, ">"),
)
FLAT_MB = 64.0  # the export's memory is flat when neither side grows by more than this while it runs


T = TypeVar("T")


class RequestFailed(RuntimeError):
    """A request answered with another status than 200, or an export that fell short."""


async def _get_json(session: aiohttp.ClientSession, path: str) -> Any:
    async with session.get(path) as response:
        body = await response.read()
        if response.status != 200:
            raise RequestFailed(f"GET {path}: {response.status} {body[:300]!r}")
    return json.loads(body)


def _instant(at: datetime) -> str:
    return quote(format_timestamp(at), safe="")


class Samples:
    """Latencies of one kind of request; a failed request is counted, with its first message, not timed."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.errors: list[str] = []

    async def take(self, work: Awaitable[T]) -> T | None:
        started = time.perf_counter()
        try:
            result = await work
        except RequestFailed as error:
            self.errors.append(str(error))
            return None
        self.seconds.append(time.perf_counter() - started)
        return result

    def summary(self) -> dict[str, Any]:
        return {
            **latency_ms(self.seconds),
            "errors": len(self.errors),
            "error": next(iter(self.errors), None),
        }


async def whole_state(session: aiohttp.ClientSession, at: datetime, first_page: list[float]) -> int:
    """Every lease live at ``at``, page after page: how many (the first page's time goes to
    ``first_page``)."""
    locks = 0
    cursor: str | None = None
    while True:
        path = f"/v1/replay/state?at={_instant(at)}&limit={STATE_PAGE}"
        if cursor is not None:
            path += f"&cursor={quote(cursor, safe='')}"
        started = time.perf_counter()
        body = await _get_json(session, path)
        if cursor is None:
            first_page.append(time.perf_counter() - started)
        locks += len(body["locks"])
        cursor = body["next_cursor"]
        if cursor is None:
            return locks


async def timeline(session: aiohttp.ClientSession, path: str, resume: str, after_key: str) -> int:
    """All the events of one history endpoint's answer, page after page: how many."""
    events = 0
    after = 0
    while True:
        body = await _get_json(session, f"{path}&limit={PAGE}&{resume}={after}")
        events += len(body["events"])
        if body[after_key] is None:
            return events
        after = body[after_key]


async def export(session: aiohttp.ClientSession, start: datetime, end: datetime | None) -> dict[str, Any]:
    """Stream the export of [start, end): lines, seconds, the first byte's delay and the last position."""
    path = f"/v1/events?from={_instant(start)}" + (f"&to={_instant(end)}" if end else "")
    lines = 0
    tail = b""
    started = time.perf_counter()
    first_byte: float | None = None
    async with session.get(path) as response:
        if response.status != 200:
            raise RequestFailed(f"GET {path}: {response.status} {(await response.read())[:300]!r}")
        try:
            async for chunk in response.content.iter_chunked(1 << 16):
                if first_byte is None:
                    first_byte = time.perf_counter() - started
                lines += chunk.count(b"\n")
                tail = (tail + chunk)[-4096:]
        except aiohttp.ClientError as error:
            elapsed = time.perf_counter() - started
            raise RequestFailed(
                f"GET {path}: cut after {lines:,} events and {elapsed:.1f} s: {error}"
            ) from error
    seconds = time.perf_counter() - started
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    position = json.loads(last)["position"] if last else None
    return {
        "events": lines,
        "seconds": round(seconds, 2),
        "events_per_s": round(lines / seconds) if seconds else None,
        "first_byte_ms": round((first_byte or 0.0) * 1e3, 1),
        "last_position": position,
    }


async def _picks(
    conn: asyncpg.Connection, events: int, count: int, rng: random.Random
) -> list[asyncpg.Record]:
    positions = [rng.randint(1, events) for _ in range(count)]
    rows = await conn.fetch(
        "SELECT e.stream_id, e.data ->> 'owner' AS owner, e.recorded_at FROM unnest($1::bigint[])"
        " WITH ORDINALITY AS p(position, ord) JOIN events e USING (position) ORDER BY p.ord",
        positions,
    )
    return list(rows)


async def _states(
    session: aiohttp.ClientSession, picks: list[asyncpg.Record], rng: random.Random
) -> dict[str, Any]:
    """The whole fleet at the instant of each pick (within the second after it), after WARMUP answers."""
    samples, first_pages, sizes = Samples(), Samples(), []
    for i, pick in enumerate(picks):
        at = pick["recorded_at"] + timedelta(microseconds=rng.randrange(1_000_000))
        pages: list[float] = []
        locks = await samples.take(whole_state(session, at, pages))
        if i < WARMUP:
            samples, first_pages = Samples(), Samples()
            continue
        first_pages.seconds.extend(pages)
        if locks is not None:
            sizes.append(locks)
    return {
        **samples.summary(),
        "first_page": latency_ms(first_pages.seconds),
        "locks_mean": round(sum(sizes) / len(sizes), 1) if sizes else None,
        "locks_max": max(sizes, default=None),
    }


async def _states_from_the_log(
    url: str, options: argparse.Namespace, token: str, picks: list[asyncpg.Record]
) -> dict[str, Any]:
    """``_states`` at the same events' instants through a server that replays from the log: its projector off,
    the projection's checkpoint covering nothing."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        covered = await conn.fetch("SELECT name, covered_until FROM projector_checkpoints")
        await conn.execute("UPDATE projector_checkpoints SET covered_until = NULL")
    finally:
        await conn.close()
    try:
        return await _states_through(url, options, token, picks)
    finally:  # the database as it was: a kept history serves the next run from its projection again
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            await conn.executemany(
                "UPDATE projector_checkpoints SET covered_until = $2 WHERE name = $1",
                [tuple(row.values()) for row in covered],
            )
        finally:
            await conn.close()


async def _states_through(
    url: str, options: argparse.Namespace, token: str, picks: list[asyncpg.Record]
) -> dict[str, Any]:
    """``_states`` through a server whose projectors are off."""
    env = {"LOCKLEDGER_PROJECTORS_ENABLED": "false"}
    server = LockledgerServer(url, options.server_workers, env=env, log_level="warning")
    await asyncio.to_thread(server.start)
    try:
        headers = {"Authorization": bearer(token)}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
        async with aiohttp.ClientSession(
            server.base_url, connector=aiohttp.TCPConnector(limit=1), headers=headers, timeout=timeout
        ) as session:
            return await _states(session, picks, random.Random(options.seed))
    finally:
        await asyncio.to_thread(server.stop)


async def _hours(session: aiohttp.ClientSession, picks: list[asyncpg.Record], subject: str) -> dict[str, Any]:
    """The hour around each pick of its resource's (``subject`` "resource") or its owner's history."""
    samples, found = Samples(), []
    for i, pick in enumerate(picks):
        start = pick["recorded_at"] - HOUR / 2
        query = f"?from={_instant(start)}&to={_instant(start + HOUR)}"
        if subject == "resource":
            path = f"/v1/locks/{quote(pick['stream_id'], safe='')}/history{query}"
            events = await samples.take(timeline(session, path, "after_version", "next_after_version"))
        else:
            path = f"/v1/agents/{quote(pick['owner'], safe='')}/history{query}"
            events = await samples.take(timeline(session, path, "after_position", "next_after_position"))
        if i < WARMUP:
            samples = Samples()
        elif events is not None:
            found.append(events)
    return {**samples.summary(), "events_mean": round(sum(found) / len(found), 1) if found else None}


async def _export(
    session: aiohttp.ClientSession, resources: Resources, start: datetime, end: datetime | None, expected: int
) -> dict[str, Any]:
    """The export of [start, end) (``expected`` events), with the memory of both sides meanwhile."""
    before = resources.mark()
    try:
        exported = await export(session, start, end)
        if exported["events"] != expected:
            raise RequestFailed(f"the export gave {exported['events']} events, not {expected}")
    except RequestFailed as error:
        return {"events": 0, "events_per_s": None, "errors": 1, "error": str(error)}
    after = resources.mark()
    usage = resources.between(before, after)
    return {
        **exported,
        "errors": 0,
        "client_rss_before_mb": round(before.rss["client"] / 2**20, 1),
        "client_peak_rss_mb": usage["client"]["peak_rss_mb"],
        "server_rss_before_mb": round(before.rss["server"] / 2**20, 1),
        "server_peak_rss_mb": usage["server"]["peak_rss_mb"],
        "server_cpu_pct": usage["server"]["cpu_pct"],
        "postgres_cpu_pct": usage.get("postgres", {}).get("cpu_pct"),
    }


async def measure(url: str, events: int, options: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Serve the loaded database and measure the replay read path on it."""
    rng = random.Random(options.seed)
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        name = f"bench-{uuid.uuid4().hex[:6]}-investigator"
        (token,) = await tokens.create_many(conn, [name], Role.INVESTIGATOR)
        states = await _picks(conn, events, options.state_samples + WARMUP, rng)
        hours = await _picks(conn, events, options.history_samples + WARMUP, rng)
        first = await conn.fetchval("SELECT recorded_at FROM events WHERE position = 1")
        export_end = None
        if events > options.export_max:
            export_end = await conn.fetchval(
                "SELECT recorded_at FROM events WHERE position = $1", options.export_max + 1
            )
        postmaster, _ = await inspect_server(url)
    finally:
        await conn.close()
    server = LockledgerServer(url, options.server_workers, log_level="warning")
    await asyncio.to_thread(server.start)
    groups: dict[str, int | None] = {"server": server.pid, "client": None}
    if postmaster is not None:
        groups["postgres"] = postmaster
    resources = Resources(groups)
    resources.start()
    record: dict[str, Any] = {}
    try:
        connector = aiohttp.TCPConnector(limit=1)
        headers = {"Authorization": bearer(token)}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
        async with aiohttp.ClientSession(
            server.base_url, connector=connector, headers=headers, timeout=timeout
        ) as session:
            console.print(f"  state at T: {options.state_samples} instants")
            record["state"] = await _states(session, states, rng)
            console.print(f"  resource and agent hours: {options.history_samples} each")
            record["resource_hour"] = await _hours(session, hours, "resource")
            record["agent_hour"] = await _hours(session, hours, "agent")
            console.print("  export")
            expected = min(events, options.export_max)
            record["export"] = await _export(session, resources, first, export_end, expected)
    finally:
        await resources.stop()
        await asyncio.to_thread(server.stop)
    console.print("  state at T from the log: the same instants")
    record["state_log"] = await _states_from_the_log(url, options, token, states)
    console.print("  verify")
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        started = time.perf_counter()
        report = await verify_chains(conn)
        elapsed = time.perf_counter() - started
    finally:
        await conn.close()
    if not report.ok:
        raise RequestFailed(f"the loaded chain does not verify: {report.broken}")
    record["verify"] = {
        "events": report.events,
        "seconds": round(elapsed, 2),
        "events_per_s": round(report.events / elapsed),
    }
    return record


def figures(record: dict[str, Any]) -> dict[str, float | None]:
    """The headline numbers of one N, by name (what the table, the ratios and the targets use)."""
    export_ = record["export"]

    def growth(side: str) -> float | None:
        peak, before = export_.get(f"{side}_peak_rss_mb"), export_.get(f"{side}_rss_before_mb")
        return None if peak is None or before is None else round(peak - before, 1)

    return {
        "load_events_per_s": record["load"]["events_per_s"] if record["load"] else None,
        "state_p50_ms": record["state"]["p50_ms"],
        "state_p95_ms": record["state"]["p95_ms"],
        "state_first_page_p95_ms": record["state"]["first_page"]["p95_ms"],
        "state_log_p95_ms": record["state_log"]["p95_ms"],
        "state_locks_mean": record["state"]["locks_mean"],
        "resource_hour_p95_ms": record["resource_hour"]["p95_ms"],
        "agent_hour_p95_ms": record["agent_hour"]["p95_ms"],
        "export_events_per_s": export_["events_per_s"],
        "export_client_growth_mb": growth("client"),
        "export_server_growth_mb": growth("server"),
        "export_server_peak_rss_mb": export_.get("server_peak_rss_mb"),
        "verify_events_per_s": record["verify"]["events_per_s"],
        "failed_requests": sum(record[kind]["errors"] for kind in MEASURED),
    }


MEASURED = ("state", "state_log", "resource_hour", "agent_hour", "export")


LABELS = {
    "load_events_per_s": "load, events/s (COPY, indexes, rebuild, vacuum)",
    "state_p50_ms": "state at T, whole fleet, p50 ms",
    "state_p95_ms": "state at T, whole fleet, p95 ms",
    "state_first_page_p95_ms": "  its first page (10,000 leases), p95 ms",
    "state_log_p95_ms": "  the same from the log (no projection), p95 ms",
    "state_locks_mean": "  leases live at T, mean",
    "resource_hour_p95_ms": "resource hour, p95 ms",
    "agent_hour_p95_ms": "agent hour, p95 ms",
    "export_events_per_s": "export, events/s",
    "export_client_growth_mb": "  client RSS growth during export, MB",
    "export_server_growth_mb": "  server RSS growth during export, MB",
    "export_server_peak_rss_mb": "  server peak RSS, MB",
    "verify_events_per_s": "verify, events/s",
    "failed_requests": "failed requests",
}


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios of the largest N's figures to the smallest's, and each target at each N."""
    by_n = {r["events"]: figures(r) for r in records}
    smallest, largest = min(by_n), max(by_n)
    ratios: dict[str, float | None] = {}
    for name in LABELS:
        low, high = by_n[smallest][name], by_n[largest][name]
        ratios[name] = round(high / low, 2) if low and high is not None else None
    goals = []
    for name, bound, sense in TARGETS:
        for n, values in sorted(by_n.items()):
            value = values[name]
            ok = value is not None and (value < bound if sense == "<" else value > bound)
            goals.append(
                {"figure": name, "events": n, "value": value, "goal": f"{sense} {bound:,.0f}", "ok": ok}
            )
    for n, values in sorted(by_n.items()):
        sides = [values["export_client_growth_mb"], values["export_server_growth_mb"]]
        growth = None if None in sides else max(v for v in sides if v is not None)
        goals.append(
            {"figure": "export_memory_growth_mb", "events": n, "value": growth, "goal": f"< {FLAT_MB:.0f}",
             "ok": growth is not None and growth < FLAT_MB}
        )  # fmt: skip
    return {"kind": "summary", "ratio_of": [largest, smallest], "ratios": ratios, "goals": goals}


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"


def print_report(console: Console, records: list[dict[str, Any]], total: dict[str, Any]) -> None:
    ns = sorted(r["events"] for r in records)
    by_n = {r["events"]: figures(r) for r in records}
    table = Table(title="replay at a year's scale", title_justify="left")
    table.add_column("figure")
    for n in ns:
        table.add_column(f"{n:,} events", justify="right")
    if len(ns) > 1:
        table.add_column(f"{ns[-1] // ns[0]:,}x N: ratio", justify="right")
    for name, label in LABELS.items():
        row = [label, *(_cell(by_n[n][name]) for n in ns)]
        if len(ns) > 1:
            ratio = total["ratios"][name]
            row.append("-" if ratio is None else f"{ratio:.2f}")
        table.add_row(*row)
    console.print(table)
    goals = Table(title="targets", title_justify="left")
    for column in ("figure", "events", "value", "goal", "met"):
        goals.add_column(column)
    for goal in total["goals"]:
        met = "[green]yes[/green]" if goal["ok"] else "[red]no[/red]"
        goals.add_row(goal["figure"], f"{goal['events']:,}", _cell(goal["value"]), goal["goal"], met)
    console.print(goals)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int_list, default=(1_000_000, 10_000_000), help="N, comma-separated")
    p.add_argument("--agents", type=positive_int, default=10_000)
    p.add_argument("--resources", type=positive_int, default=100_000)
    p.add_argument("--state-samples", type=positive_int, default=20, help="instants T (default: 20)")
    p.add_argument("--history-samples", type=positive_int, default=100, help="hours of each kind (100)")
    p.add_argument("--export-max", type=positive_int, default=2_000_000, help="events exported, at most")
    p.add_argument("--server-workers", type=positive_int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--database-url", help="a PostgreSQL server (a superuser): a fresh database per N")
    p.add_argument(
        "--keep", action="store_true", help="keep each loaded database on --database-url, for --loaded"
    )
    p.add_argument(
        "--loaded",
        action="append",
        default=[],
        metavar="URL",
        help="measure a database loaded by an earlier run (--keep) as it is, instead of loading; repeatable",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON lines (default: bench/results/history-*)")
    options = p.parse_args(argv)
    if options.keep and not options.database_url:
        p.error("--keep needs --database-url: the embedded server goes with its run")
    return options


def load(url: str, shape: HistoryShape, console: Console) -> LoadReport:
    shown = [0.0]

    def progress(done: int, elapsed: float) -> None:
        if elapsed - shown[0] >= 5 or done == shape.events:
            shown[0] = elapsed
            console.print(
                f"  {done:,} / {shape.events:,} events ({done / shape.events:.0%}), {done / elapsed:,.0f}/s",
                highlight=False,
            )

    report: LoadReport = run_async(lambda: load_history(url, shape, progress))
    console.print(
        f"  loaded {report.events:,} events on {report.streams:,} streams in {report.seconds:.0f} s "
        f"({report.events_per_s:,.0f}/s; rows {report.copy_seconds:.0f} s, "
        f"indexes {report.index_seconds:.0f} s, rebuild {report.rebuild_seconds:.0f} s, "
        f"projections {report.projections_seconds:.0f} s, "
        f"vacuum {report.vacuum_seconds:.0f} s), {report.database_mb:,.0f} MB",
        highlight=False,
    )
    return report


def run_loaded(url: str, options: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Measure the history an earlier run loaded and kept at ``url``: the ``history`` record."""
    started = time.perf_counter()
    events = run_async(lambda: _events_in(url))
    console.print(f"[bold]{events:,} events[/bold]: loaded before, at {url}")
    measured = run_async(lambda: measure(url, events, options, console))
    return {"kind": "history", "events": events, "load": None, **measured,
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


async def _events_in(url: str) -> int:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        events: int = await conn.fetchval("SELECT count(*) FROM events")
    finally:
        await conn.close()
    return events


def run_one(url: str, events: int, options: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Load N events into the fresh database at ``url`` and measure: the ``history`` record."""
    shape = HistoryShape(events=events, agents=options.agents, resources=options.resources, seed=options.seed)
    started = time.perf_counter()
    report = load(url, shape, console)
    measured = run_async(lambda: measure(url, report.events, options, console))
    return {"kind": "history", "events": events, "load": report.record(), **measured,
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    out = JsonLines(options.out or default_path("history-", RESULTS_DIR))
    records: list[dict[str, Any]] = []
    failed = False
    for record in _runs(options, console, out):
        if record is None:
            failed = True
            continue
        records.append(record)
        out.write(record)
        console.print(f"  {record['events']:,} events done in {record['seconds']:.0f} s", highlight=False)
        for kind in MEASURED:
            if errors := record[kind]["errors"]:
                failed = True
                first = record[kind]["error"]
                console.print(f"  [red]{kind}: {errors} failed[/red], the first: {first}", highlight=False)
    if records:
        total = summary(records)
        out.write(total)
        print_report(console, records, total)
    console.print(f"results: {out.path}")
    return 1 if failed else 0


def _runs(options: argparse.Namespace, console: Console, out: JsonLines) -> Iterator[dict[str, Any] | None]:
    """Each N's ``history`` record (None: its measuring failed), the environment record written first:
    the databases named by ``--loaded`` as they are, or else a fresh database per N, loaded."""
    for index, url in enumerate(options.loaded):
        if index == 0:
            out.write(_environment(run_async(partial(inspect_server, url))[1], options))
        yield _measured(partial(run_loaded, url, options, console), console)
    for index, n in enumerate([] if options.loaded else options.events):
        console.print(f"[bold]{n:,} events[/bold]: a fresh database")
        db = provision(options.database_url)
        try:
            if index == 0:
                out.write(_environment(db.info, options))
            yield _measured(partial(run_one, db.url, n, options, console), console)
        finally:
            if options.keep:
                console.print(f"  kept: --loaded {db.url}", highlight=False)
            else:
                db.close()


def _measured(run: Callable[[], dict[str, Any]], console: Console) -> dict[str, Any] | None:
    try:
        return run()
    except RequestFailed as error:
        console.print(f"[red]{error}[/red]")
        return None


def _environment(info: dict[str, Any], options: argparse.Namespace) -> dict[str, Any]:
    settings = dict(info)
    return {
        "kind": "environment",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, "-m", "bench.history", *sys.argv[1:]]),
        **machine_environment(),
        "postgresql": settings.pop("postgresql", None),
        "postgresql_settings": settings,
        "auth": AUTH,
        "server_workers": options.server_workers,
        "agents": options.agents,
        "resources": options.resources,
    }


if __name__ == "__main__":
    sys.exit(main())
