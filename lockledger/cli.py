"""The `lockledger` command: serve, reaper, migrate, rebuild, verify, tokens, bench.

Server packages are imported inside each command, so `lockledger --help` stays fast and the SDK part of
this package never needs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

from lockledger.dburl import DATABASE_URL_ENV, asyncpg_dsn

if TYPE_CHECKING:
    import asyncpg

T = TypeVar("T")

app = typer.Typer(no_args_is_help=True, help="lockledger: leases with fencing tokens, on an event log.")
console = Console(stderr=True)

DataDir = Annotated[
    Path | None,
    typer.Option(help="Data directory of the embedded PostgreSQL used when no database URL is set."),
]
DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", envvar=DATABASE_URL_ENV, help="PostgreSQL URL.")
]


def _resolve_database(database_url: str | None, data_dir: Path | None) -> tuple[str, bool]:
    """The database URL to use, starting the embedded server when none is given."""
    if database_url:
        return database_url, False
    from lockledger import embedded

    console.print(
        "[yellow]No LOCKLEDGER_DATABASE_URL: starting the embedded PostgreSQL "
        f"in {data_dir or embedded.default_data_dir()}[/yellow]"
    )
    server = embedded.start(data_dir)
    return server.ensure_database(), True


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While serving, SIGTERM ends the process by SystemExit (status 143, as a shell reports a death by
    SIGTERM) instead of by the signal's default action.

    uvicorn ends a graceful shutdown by raising the signal that asked for it again, so that the process
    dies of it as its supervisor expects. Dying of SIGTERM skips ``atexit``, where the embedded
    PostgreSQL's handle is released: the server kept running on the data directory after the service
    was gone, and since the handle of the dead process stayed registered, no later run stopped it either.
    Ctrl-C already unwinds (SIGINT's Python handler raises KeyboardInterrupt)."""

    def exit_143(signum: int, frame: object) -> None:
        raise SystemExit(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _migrate(url: str) -> None:
    from lockledger.migrate import upgrade

    upgrade(url)
    console.print("[green]schema migrated to head[/green]")


# uvicorn without per-request work the service does not need: access lines (structlog and /metrics cover
# it), proxy header rewriting (no proxy in front by default), Server and Date headers; and httptools with
# a cap on unfinished request heads (it holds one in memory without bound; this protocol answers 431),
# which also ends waiting acquires when a graceful shutdown begins (api/draining.py).
_UVICORN_OPTIONS: dict[str, Any] = {
    "http": "api.draining:DrainingHttpToolsProtocol",
    "access_log": False,
    "proxy_headers": False,
    "server_header": False,
    "date_header": False,
}


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
    migrate: Annotated[
        bool | None, typer.Option(help="Migrate before serving (default: only for the embedded server).")
    ] = None,
    reaper: Annotated[
        bool, typer.Option(envvar="LOCKLEDGER_REAPER_ENABLED", help="Run the reaper inside the server.")
    ] = True,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
    workers: Annotated[
        int, typer.Option(min=1, max=64, help="Server processes (each with its own pool).")
    ] = 1,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev",
            envvar="LOCKLEDGER_DEV_MODE",
            help="Dev mode: no authentication, owners named in the body. Never on a shared network.",
        ),
    ] = False,
) -> None:
    """Serve the HTTP API (and the reaper). Without a database URL, an embedded PostgreSQL is started."""

    from api.app import create_app
    from service.config import Settings

    url, embedded = _resolve_database(database_url, data_dir)
    if migrate if migrate is not None else embedded:
        _migrate(url)
    settings = Settings(database_url=url, reaper_enabled=reaper, dev_mode=dev)
    base = f"http://{host}:{port}"
    console.print(f"[bold]lockledger[/bold] serving on {base}")
    console.print(f"  API docs (Swagger UI): {base}/docs")
    console.print(f"  API docs (ReDoc):      {base}/redoc")
    console.print(f"  OpenAPI schema:        {base}/openapi.json")
    console.print(f"  health: {base}/healthz  readiness: {base}/readyz  metrics: {base}/metrics")
    if dev:
        console.print(
            "[bold red]DEV MODE: authentication is OFF. Anyone who reaches this port can take, release and"
            " force-release any lock. Never expose it.[/bold red]"
        )
    else:
        console.print(
            "  authentication: on; create a token with "
            "`lockledger tokens create --name NAME --role agent|dashboard|investigator|admin`"
        )
    import uvicorn

    if workers == 1:
        with _sigterm_unwinds():
            uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, **_UVICORN_OPTIONS)
        return
    from lockledger.workers import Supervisor

    # Worker processes build their app from the environment; each runs a reaper (they share the work).
    os.environ[DATABASE_URL_ENV] = url
    os.environ["LOCKLEDGER_REAPER_ENABLED"] = "true" if reaper else "false"
    os.environ["LOCKLEDGER_DEV_MODE"] = "true" if dev else "false"
    config = uvicorn.Config(
        "api.app:create_app", factory=True, host=host, port=port, log_level=log_level, **_UVICORN_OPTIONS
    )
    try:
        status = Supervisor(config, workers).run()
    except OSError as error:  # the port is taken
        console.print(f"[red]cannot serve on {host}:{port}: {error.strerror}[/red]")
        raise typer.Exit(1) from error
    if status:
        raise typer.Exit(status)


@app.command("reaper")
def run_reaper(database_url: DatabaseUrl = None) -> None:
    """Run a standalone reaper (several may run at once; they share the work)."""
    from service.config import Settings
    from service.database import create_pool
    from service.reaper import Reaper

    if not database_url:
        console.print(f"[red]set {DATABASE_URL_ENV} or --database-url[/red]")
        raise typer.Exit(2)

    async def main() -> None:
        settings = Settings(database_url=database_url)
        pool = await create_pool(settings)
        reaper = Reaper(pool, settings)
        console.print(f"reaper {reaper.reaper_id} running; Ctrl-C to stop")
        try:
            await reaper.run()
        finally:
            await pool.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


async def _with_connection(url: str, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    """Run ``work`` on one connection as the URL's own role (the schema owner), then close it."""
    import asyncpg

    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await work(conn)
    finally:
        await conn.close()


@app.command()
def migrate(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Create or upgrade the schema (tables, triggers, the service role's grants)."""
    url, _ = _resolve_database(database_url, data_dir)
    _migrate(url)


@app.command()
def rebuild(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Rebuild the lock_state projection from the event log (run as the schema owner)."""

    from projections.rebuild import rebuild_lock_state

    url, _ = _resolve_database(database_url, data_dir)

    rows = asyncio.run(_with_connection(url, rebuild_lock_state))
    console.print(f"[green]lock_state rebuilt from the log: {rows} resources[/green]")


@app.command()
def verify(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Recompute every stream's hash chain; exit 1 and name the first broken link if any."""

    from eventstore.verify import verify_chains

    url, _ = _resolve_database(database_url, data_dir)

    async def main() -> int:
        report = await _with_connection(
            url,
            lambda conn: verify_chains(conn, progress=lambda n: console.print(f"  {n:,} events verified")),
        )
        if report.broken:
            link = report.broken
            console.print(f"[red]BROKEN: stream {link.stream_id} version {link.version}: {link.reason}[/red]")
            return 1
        console.print(
            f"[green]OK: {report.events:,} events in {report.streams:,} streams, chains intact[/green]"
        )
        return 0

    sys.exit(asyncio.run(main()))


tokens_app = typer.Typer(no_args_is_help=True, help="API tokens: create, list, revoke.")
app.add_typer(tokens_app, name="tokens")

RoleOption = Annotated[
    str, typer.Option(help="agent (holds leases as NAME), dashboard, investigator, or admin.")
]


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="The principal; for an agent, the owner of its leases.")],
    role: RoleOption,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Issue a token. It is printed once, to stdout; only its SHA-256 is stored."""
    from domain.access import Role
    from service import tokens

    try:
        chosen = Role(role)
    except ValueError:
        console.print(f"[red]unknown role {role!r}; choose one of: {', '.join(Role)}[/red]")
        raise typer.Exit(2) from None
    url, _ = _resolve_database(database_url, data_dir)
    try:
        token = asyncio.run(_with_connection(url, lambda conn: tokens.create(conn, name, chosen)))
    except tokens.TokenError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    console.print(f"[green]token for {name} ({chosen}); store it now, it is not shown again:[/green]")
    print(token)


@tokens_app.command("list")
def tokens_list(
    all_tokens: Annotated[bool, typer.Option("--all", help="Include revoked tokens.")] = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """List tokens (names, roles, dates; never the tokens themselves)."""
    from rich.table import Table

    from service import tokens

    url, _ = _resolve_database(database_url, data_dir)
    rows = asyncio.run(_with_connection(url, lambda conn: tokens.list_all(conn, include_revoked=all_tokens)))
    table = Table("id", "name", "role", "created", "revoked")
    for row in rows:
        revoked = row.revoked_at.isoformat(timespec="seconds") if row.revoked_at else ""
        table.add_row(str(row.id), row.name, row.role, row.created_at.isoformat(timespec="seconds"), revoked)
    Console().print(table)


@tokens_app.command("revoke")
def tokens_revoke(
    name: Annotated[str, typer.Option(help="Revoke every live token of this principal.")],
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Revoke a principal's tokens; servers stop accepting them within their auth cache time (10 s)."""
    from service import tokens

    url, _ = _resolve_database(database_url, data_dir)
    count = asyncio.run(_with_connection(url, lambda conn: tokens.revoke(conn, name)))
    if count == 0:
        console.print(f"[yellow]{name} has no live tokens[/yellow]")
        raise typer.Exit(1)
    console.print(f"[green]revoked {count} token(s) of {name}[/green]")


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def bench(ctx: typer.Context) -> None:
    """Benchmark lockledger against its baselines (options: `lockledger bench --help`)."""
    from bench.cli import main

    sys.exit(main(list(ctx.args), prog="lockledger bench"))


if __name__ == "__main__":
    app()
