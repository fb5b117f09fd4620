"""What the server's commands share: the console they talk on, and the database they work on.

A command works on ``--database-url`` (or ``LOCKLEDGER_DATABASE_URL``) when given, else on the embedded
PostgreSQL of ``--data-dir``, started (and migrated) if no process runs it yet.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from eventstore.dburl import DATABASE_URL_ENV, asyncpg_dsn
from eventstore.embedded import DATA_DIR_ENV

if TYPE_CHECKING:
    import asyncpg

T = TypeVar("T")

# soft_wrap: a message is one line however narrow the terminal, or a log, says it is.
console = Console(stderr=True, soft_wrap=True)

DataDir = Annotated[
    Path | None,
    typer.Option(
        envvar=DATA_DIR_ENV,
        show_default="a source checkout's .lockledger/pgdata, else the user data directory",
        help="Data directory of the embedded PostgreSQL used when no database URL is set.",
    ),
]
DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", envvar=DATABASE_URL_ENV, help="PostgreSQL URL.")
]


def data_dir_of(data_dir: Path | None) -> Path:
    from eventstore import embedded

    return (data_dir or embedded.default_data_dir()).expanduser().resolve()


def resolve_database(
    database_url: str | None, data_dir: Path | None, *, migrate: bool = True
) -> tuple[str, bool]:
    """The database URL to use and whether it is the embedded server's: the URL given, or the embedded
    server of the data directory, attached to if a process already runs it, else started (and, with
    ``migrate``, migrated, so that every command finds the schema). A server this process starts is
    stopped when it exits, unless other processes have attached to it by then; one it attached to is
    left to them."""
    if database_url:
        return database_url, False
    from eventstore import embedded

    directory = data_dir_of(data_dir)
    found = embedded.running(directory)
    shown = escape(str(directory))
    if found is None:
        console.print(f"[yellow]No {DATABASE_URL_ENV}: starting the embedded PostgreSQL in {shown}[/yellow]")
    elif found.holders:
        console.print(f"using the embedded PostgreSQL already running in {shown} (pid {found.pid})")
    else:
        console.print(
            f"using the embedded PostgreSQL already running in {shown} (pid {found.pid}); the process"
            " that started it has exited, so it stops when this command does"
        )
    server = embedded.start(directory)
    url = server.ensure_database()
    if migrate and server.attached_to is None:
        from migrations.upgrade import upgrade

        upgrade(url)
    return url, True


async def with_connection(url: str, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    """Run ``work`` on one connection as the URL's own role (the schema owner), then close it."""
    import asyncpg

    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await work(conn)
    finally:
        await conn.close()
