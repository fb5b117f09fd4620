"""Archive and restore at scale: ``python -m bench.archive --events 1000000``.

A fresh database (the bench's embedded PostgreSQL, or a new database on ``--database-url``) gets N events
of synthetic fleet history over a year in monthly partitions (``bench/history_load.py``). Then, as
``lockledger archive`` and ``lockledger restore`` do it (``eventstore/archive.py``):

- ``archive``: the oldest ``--months`` partitions to files; events/s, the files' bytes per event, and
  the database's size before and after (``pg_database_size``);
- ``verify``: every chain through the files and on into the live log (``verify --archives``); events/s;
- ``restore``: the same partitions back from their files; events/s, and the database's size after.

A table on stdout and JSON lines in ``bench/results/archive-<timestamp>.jsonl``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from rich.console import Console
from rich.table import Table

from bench.cli import positive_int
from bench.database import provision
from bench.environment import environment as machine_environment
from bench.history import load
from bench.history_load import HistoryShape
from bench.output import RESULTS_DIR, JsonLines, default_path
from bench.runner import run_async
from eventstore.archive import MIGRATOR_ROLE, archive_partition, partitions, restore_archive
from eventstore.archive_file import ArchiveSource, walk_archive
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import ChainWalk, verify_chains

MB = 1024 * 1024


async def _size_mb(conn: asyncpg.Connection) -> float:
    return round(int(await conn.fetchval("SELECT pg_database_size(current_database())")) / MB, 1)


async def measure(url: str, months: int, directory: Path, console: Console) -> dict[str, Any]:
    conn = await asyncpg.connect(asyncpg_dsn(url), server_settings={"role": MIGRATOR_ROLE, "timezone": "UTC"})
    try:
        await conn.execute("SET statement_timeout = 0")
        size_before = await _size_mb(conn)
        chosen = []
        for partition in await partitions(conn):
            count = int(await conn.fetchval(f'SELECT count(*) FROM "{partition.name}"'))
            if count:
                chosen.append((partition, count))
            if len(chosen) == months:
                break
        archived_events = sum(count for _, count in chosen)
        console.print(f"  archiving {len(chosen)} partition(s), {archived_events:,} events", highlight=False)
        started = time.perf_counter()
        records = [await archive_partition(conn, partition, directory) for partition, _ in chosen]
        archive_s = time.perf_counter() - started
        file_bytes = sum((directory / r.file_name).stat().st_size for r in records)
        size_after = await _size_mb(conn)

        walk = ChainWalk()
        started = time.perf_counter()
        for record in records:
            assert (
                walk_archive(ArchiveSource(directory / record.file_name, record.content_sha256), walk) is None
            )
        report = await verify_chains(conn, walk=walk)
        verify_s = time.perf_counter() - started
        if not report.ok:
            raise RuntimeError(f"verify across the archives failed: {report.broken}")

        started = time.perf_counter()
        for record in reversed(records):
            await restore_archive(conn, directory / record.file_name)
        restore_s = time.perf_counter() - started
        size_restored = await _size_mb(conn)
    finally:
        await conn.close()
    return {
        "partitions": [r.partition for r in records],
        "archived_events": archived_events,
        "archive": {"seconds": round(archive_s, 2), "events_per_s": round(archived_events / archive_s)},
        "file_bytes": file_bytes,
        "file_bytes_per_event": round(file_bytes / archived_events, 1),
        "database_mb": {"before": size_before, "archived": size_after, "restored": size_restored},
        "verify": {
            "events": report.events,
            "seconds": round(verify_s, 2),
            "events_per_s": round(report.events / verify_s),
        },
        "restore": {"seconds": round(restore_s, 2), "events_per_s": round(archived_events / restore_s)},
    }


def print_report(console: Console, record: dict[str, Any]) -> None:
    table = Table(title=f"archive and restore, {record['events']:,} events in the log")
    table.add_column("figure")
    table.add_column("value", justify="right")
    sizes = record["database_mb"]
    rows = [
        ("partitions archived", ", ".join(record["partitions"])),
        ("events archived", f"{record['archived_events']:,}"),
        ("archive, events/s", f"{record['archive']['events_per_s']:,}"),
        ("file bytes per event", f"{record['file_bytes_per_event']}"),
        ("database MB before / after archive", f"{sizes['before']:,} / {sizes['archived']:,}"),
        ("verify through the files, events/s", f"{record['verify']['events_per_s']:,}"),
        ("restore, events/s", f"{record['restore']['events_per_s']:,}"),
        ("database MB after restore", f"{sizes['restored']:,}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.archive", description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=positive_int, default=1_000_000, help="N events of history")
    p.add_argument("--months", type=positive_int, default=1, help="oldest partitions archived (1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--database-url", help="a PostgreSQL server (a superuser): a fresh database")
    p.add_argument("--out", type=Path, default=None, help="JSON lines (default: bench/results/archive-*)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    out = JsonLines(options.out or default_path("archive-", RESULTS_DIR))
    db = provision(options.database_url)
    try:
        out.write(
            {
                "kind": "environment",
                "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
                "command": shlex.join([Path(sys.executable).name, "-m", "bench.archive", *sys.argv[1:]]),
                **machine_environment(),
                "postgresql": db.info.get("postgresql"),
            }
        )
        console.print(f"[bold]{options.events:,} events[/bold]: a fresh database")
        load(db.url, HistoryShape(events=options.events, seed=options.seed), console)
        with tempfile.TemporaryDirectory(prefix="lockledger-archive-bench-") as directory:
            measured = run_async(lambda: measure(db.url, options.months, Path(directory), console))
        record = {"kind": "archive", "events": options.events, **measured}
        out.write(record)
        print_report(console, record)
    finally:
        db.close()
    console.print(f"results: {out.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
