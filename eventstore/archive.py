"""Archive and restore whole partitions of the log, and the catalog that remembers them.

Archiving a partition writes its events to a file (``eventstore/archive_file.py``) in a directory the
operator names, reads the file back whole (its digest and its count against the partition's), and only
then, in one transaction, records the file in ``event_archives`` and detaches and drops the partition.
A crash at any step leaves either the partition in the log or a recorded, verified file; a file written
but not recorded is written again by the next run.

Only whole partitions whose range ended a while ago (``SETTLE``) are archived: nothing can still be
appended to them. Restoring reads the file into a table of its own and attaches it again, in one
transaction; the file's digest is checked against the catalog's before anything is committed.

These run as the schema's owner (the ``lockledger_migrator`` role): dropping a partition is DDL, which
the service's own role can never do. The locks they take on ``events`` are held for a moment and given
up after ``LOCK_TIMEOUT`` rather than queueing appends behind them; the next run tries again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from eventstore.archive_file import (
    COLUMNS,
    ArchivedEvent,
    ArchiveHeader,
    ArchiveReader,
    ArchiveTrailer,
    ArchiveWriter,
)
from eventstore.connection import Connection

MIGRATOR_ROLE = "lockledger_migrator"
SETTLE = timedelta(minutes=1)  # a partition is archived only once its range ended this long ago
LOCK_TIMEOUT = "2s"
SUFFIX = ".ndjson.zst"
BATCH = 5_000

# Every partition of events but the DEFAULT one, oldest first, with its bounds.
PARTITIONS_SQL = r"""
SELECT name, lower_bound, upper_bound
  FROM (SELECT c.relname AS name,
               substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \(''([^'']+)''\)')::timestamptz
                   AS lower_bound,
               substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''([^'']+)''\)')::timestamptz
                   AS upper_bound
          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'public.events'::regclass) AS p
 WHERE upper_bound IS NOT NULL
 ORDER BY lower_bound
"""

READ_SQL = """
SELECT position, stream_id, stream_version, event_id::text AS event_id, event_type, data::text AS data,
       metadata::text AS metadata, recorded_at, tx_id, hash
  FROM {table}
 ORDER BY stream_id, stream_version
"""

RECORD_SQL = """
INSERT INTO event_archives (partition, lower_bound, upper_bound, file_name, events, first_position,
                            last_position, content_sha256, archived_at, restored_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, clock_timestamp(), NULL)
ON CONFLICT (partition) DO UPDATE
   SET file_name = excluded.file_name, events = excluded.events, first_position = excluded.first_position,
       last_position = excluded.last_position, content_sha256 = excluded.content_sha256,
       archived_at = excluded.archived_at, restored_at = NULL
"""

CATALOG_SQL = """
SELECT partition, lower_bound AS start, upper_bound AS "end", file_name, events, first_position,
       last_position, content_sha256, archived_at, restored_at
  FROM event_archives
 ORDER BY lower_bound
"""


class ArchiveError(RuntimeError):
    """An archive or restore that cannot go on; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Partition:
    name: str
    start: datetime
    end: datetime


@dataclass(frozen=True, slots=True)
class ArchiveRecord:
    """A row of ``event_archives``: a partition that was archived to ``file_name``."""

    partition: str
    start: datetime
    end: datetime
    file_name: str
    events: int
    first_position: int | None
    last_position: int | None
    content_sha256: str
    archived_at: datetime
    restored_at: datetime | None

    @property
    def archived(self) -> bool:
        """Its events are in the file only (not restored into the log since)."""
        return self.restored_at is None

    def restore_hint(self) -> str:
        return f"lockledger restore {self.file_name}"


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def partitions(conn: Connection) -> list[Partition]:
    """The log's partitions with a range (not the DEFAULT one), oldest first."""
    rows = await conn.fetch(PARTITIONS_SQL)
    return [Partition(row["name"], row["lower_bound"], row["upper_bound"]) for row in rows]


async def catalog(conn: Connection) -> list[ArchiveRecord]:
    """Every partition ever archived, oldest first (restored ones too, with ``restored_at``)."""
    return [ArchiveRecord(**dict(row)) for row in await conn.fetch(CATALOG_SQL)]


async def archivable(conn: Connection, before: datetime) -> list[Partition]:
    """The partitions wholly before ``before`` whose range ended at least ``SETTLE`` ago, oldest first."""
    now: datetime = await conn.fetchval("SELECT clock_timestamp()")
    return [p for p in await partitions(conn) if p.end <= before and p.end <= now - SETTLE]


def _event(row: Any) -> ArchivedEvent:
    return ArchivedEvent(
        row["position"],
        row["stream_id"],
        row["stream_version"],
        row["event_id"],
        row["event_type"],
        row["data"],
        row["metadata"],
        row["recorded_at"],
        int(row["tx_id"]),
        bytes(row["hash"]),
    )


def _write_batch(writer: ArchiveWriter, rows: list[Any]) -> None:
    for row in rows:
        writer.write(_event(row))


def _read_whole(path: Path) -> ArchiveTrailer:
    """Read a file to its end (the reader checks its digest and count against its trailer)."""
    with ArchiveReader(path) as reader:
        for _ in reader:
            pass
        assert reader.trailer is not None
        return reader.trailer


async def archive_partition(
    conn: Connection, partition: Partition, directory: Path, progress: Callable[[int], None] | None = None
) -> ArchiveRecord:
    """Write ``partition`` to a file in ``directory``, prove the file whole, then record it and drop the
    partition (see the module's docstring). File I/O and compression run off the event loop."""
    path = directory / f"{partition.name}{SUFFIX}"
    header = ArchiveHeader(partition.name, partition.start, partition.end)
    writer = await asyncio.to_thread(ArchiveWriter, path, header)
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            expected = int(await conn.fetchval(f"SELECT count(*) FROM {_quoted(partition.name)}"))
            cursor = await conn.cursor(READ_SQL.format(table=_quoted(partition.name)))
            written = 0
            while rows := await cursor.fetch(BATCH):
                await asyncio.to_thread(_write_batch, writer, rows)
                written += len(rows)
                if progress is not None:
                    progress(written)
        trailer = await asyncio.to_thread(writer.finish)
    except BaseException:
        await asyncio.to_thread(writer.abandon)
        raise
    reread = await asyncio.to_thread(_read_whole, path)
    if reread.content_sha256 != trailer.content_sha256 or reread.events != expected:
        raise ArchiveError(f"{path}: read back {reread.events} events of {expected}; the partition is kept")
    async with conn.transaction():
        await conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        # Still exactly what was written: a row appended since (it cannot be, past SETTLE) keeps the log.
        now = int(await conn.fetchval(f"SELECT count(*) FROM {_quoted(partition.name)}"))
        if now != expected:
            raise ArchiveError(f"{partition.name} changed while it was archived; it is kept")
        await conn.execute(
            RECORD_SQL,
            partition.name,
            partition.start,
            partition.end,
            path.name,
            trailer.events,
            trailer.first_position,
            trailer.last_position,
            trailer.content_sha256,
        )
        await conn.execute(f"ALTER TABLE events DETACH PARTITION {_quoted(partition.name)}")
        await conn.execute(f"DROP TABLE {_quoted(partition.name)}")
    record = next(r for r in await catalog(conn) if r.partition == partition.name)
    return record


async def archive_before(
    conn: Connection,
    before: datetime,
    directory: Path,
    on_partition: Callable[[Partition], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[ArchiveRecord]:
    """Archive every partition wholly before ``before`` (see :func:`archivable`), oldest first."""
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    done = []
    for partition in await archivable(conn, before):
        if on_partition is not None:
            on_partition(partition)
        done.append(await archive_partition(conn, partition, directory, progress))
    return done


async def restore_archive(
    conn: Connection, path: Path, progress: Callable[[int], None] | None = None
) -> ArchiveRecord:
    """Bring an archived partition back into the log from its file (see the module's docstring)."""
    header = await asyncio.to_thread(lambda: ArchiveReader(path).header)
    records = {r.partition: r for r in await catalog(conn)}
    record = records.get(header.partition)
    if record is None:
        raise ArchiveError(f"{path}: partition {header.partition} was never archived from this log")
    if not record.archived:
        raise ArchiveError(f"{path}: partition {header.partition} is in the log already (restored)")
    table = _quoted(header.partition)
    reader = await asyncio.to_thread(ArchiveReader, path)
    try:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            await conn.execute(f"CREATE TABLE {table} (LIKE events INCLUDING DEFAULTS)")
            events = iter(reader)
            copied = 0
            while batch := await asyncio.to_thread(_next_batch, events):
                await conn.copy_records_to_table(
                    header.partition,
                    records=[_record(event) for event in batch],
                    columns=list(COLUMNS),
                )
                copied += len(batch)
                if progress is not None:
                    progress(copied)
            if reader.trailer is None or reader.trailer.content_sha256 != record.content_sha256:
                raise ArchiveError(
                    f"{path}: its digest is not the one recorded when {header.partition} was archived"
                    f" ({record.content_sha256}); nothing was restored"
                )
            for trigger, when in _STATEMENT_TRIGGERS:
                await conn.execute(
                    f"CREATE TRIGGER {trigger} BEFORE {when} ON {table}"
                    " FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change()"
                )
            bounds = f"FROM ({_literal(header.start)}) TO ({_literal(header.end)})"
            await conn.execute(f"ALTER TABLE events ATTACH PARTITION {table} FOR VALUES {bounds}")
            await conn.execute(
                "UPDATE event_archives SET restored_at = clock_timestamp() WHERE partition = $1",
                header.partition,
            )
    finally:
        reader.close()
    return next(r for r in await catalog(conn) if r.partition == header.partition)


_STATEMENT_TRIGGERS = (("events_append_only", "UPDATE OR DELETE"), ("events_no_truncate", "TRUNCATE"))


def _record(event: ArchivedEvent) -> tuple[Any, ...]:
    """The event as a row of ``events``, in the file's column order."""
    return tuple(getattr(event, column) for column in COLUMNS)


def _next_batch(events: Any) -> list[ArchivedEvent]:
    return [event for _, event in zip(range(BATCH), events, strict=False)]


def _literal(at: datetime) -> str:
    return "'" + at.isoformat() + "'"


def archive_paths(records: Sequence[ArchiveRecord], directory: Path) -> list[Path]:
    """The files of the partitions archived (and not restored), oldest first, in ``directory``;
    raises :class:`ArchiveError` naming any that is missing."""
    paths = [directory / r.file_name for r in records if r.archived]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise ArchiveError(f"archive files missing from {directory}: {', '.join(missing)}")
    return paths
