"""`lockledger archive` and `lockledger restore`: old partitions of the log to files and back.

Both run as the schema's owner (the URL's own role, switched to ``lockledger_migrator``), the only role
that may drop or attach a partition. See eventstore/archive.py for what each step guarantees.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from api.cli_database import DatabaseUrl, DataDir, console, resolve_database, with_connection

if TYPE_CHECKING:
    import asyncpg

    from eventstore.archive import ArchiveRecord

ArchiveDir = Annotated[
    Path,
    typer.Option(
        "--dir",
        envvar="LOCKLEDGER_ARCHIVE_DIR",
        file_okay=False,
        help="Directory of the archive files.",
    ),
]


def _day(text: str) -> datetime:
    """A date (the start of that UTC day) or an ISO 8601 instant with an offset."""
    try:
        return datetime.combine(date.fromisoformat(text), time(), UTC)
    except ValueError:
        pass
    try:
        instant = datetime.fromisoformat(text)
    except ValueError:
        raise typer.BadParameter(
            "a date (2026-01-31) or an instant with an offset (2026-01-31T00:00Z)"
        ) from None
    if instant.tzinfo is None:
        raise typer.BadParameter("an instant needs its UTC offset, e.g. 2026-01-31T00:00:00Z")
    return instant


async def _as_migrator(conn: asyncpg.Connection) -> None:
    import asyncpg

    from eventstore.archive import MIGRATOR_ROLE, ArchiveError

    try:
        await conn.execute(f"SET ROLE {MIGRATOR_ROLE}")
    except asyncpg.InsufficientPrivilegeError:
        raise ArchiveError(
            f"the database user cannot SET ROLE {MIGRATOR_ROLE}: archive and restore run as the role that"
            " owns the partitions; use the user that ran `lockledger migrate`"
        ) from None


def _describe(record: ArchiveRecord) -> str:
    return (
        f"{record.partition} [{record.start.isoformat()}, {record.end.isoformat()}): {record.events:,} events"
        f" -> {record.file_name} (sha256 {record.content_sha256})"
    )


def archive(
    before: Annotated[
        str,
        typer.Option(
            help="Archive every partition whose range ends at or before this date (UTC midnight) or instant."
        ),
    ],
    directory: ArchiveDir,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Write each whole partition older than --before to a compressed file in --dir, prove the file, then
    drop the partition from the database. Prints each file's digest; keep them with the log digest."""
    from eventstore.archive import ArchiveError, archive_before

    cutoff = _day(before)
    url, _ = resolve_database(database_url, data_dir)

    async def work(conn: asyncpg.Connection) -> list[ArchiveRecord]:
        await _as_migrator(conn)
        return await archive_before(
            conn,
            cutoff,
            directory,
            on_partition=lambda p: console.print(
                f"archiving {p.name} [{p.start.isoformat()}, {p.end.isoformat()})"
            ),
            progress=lambda n: console.print(f"  {n:,} events written") if n % 100_000 == 0 else None,
        )

    try:
        done = asyncio.run(with_connection(url, work))
    except ArchiveError as error:
        console.print(f"[red]{escape(str(error))}[/red]")
        sys.exit(1)
    if not done:
        console.print(
            f"nothing to archive: no partition ends at or before {cutoff.isoformat()} (and a minute ago)"
        )
    for record in done:
        console.print(f"[green]archived {escape(_describe(record))}[/green]")
        print(f"{record.file_name} {record.content_sha256}")


def restore(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="An archive file.")],
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Bring an archived partition back into the log from its file; its digest must be the one recorded
    when it was archived."""
    from eventstore.archive import ArchiveError, restore_archive
    from eventstore.archive_file import ArchiveCorrupt

    url, _ = resolve_database(database_url, data_dir)

    async def work(conn: asyncpg.Connection) -> ArchiveRecord:
        await _as_migrator(conn)
        return await restore_archive(
            conn, file, progress=lambda n: console.print(f"  {n:,} events read") if n % 100_000 == 0 else None
        )

    try:
        record = asyncio.run(with_connection(url, work))
    except (ArchiveError, ArchiveCorrupt) as error:
        console.print(f"[red]{escape(str(error))}[/red]")
        sys.exit(1)
    console.print(f"[green]restored {escape(_describe(record))}[/green]")
