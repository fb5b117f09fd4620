"""The `lockledger` command: serve, reaper, migrate, rebuild, verify, archive, restore, tokens, psql, cluster.

Server packages are imported inside each command, so `lockledger --help` stays fast and the SDK part of
this package never needs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import functools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from api.archive_cli import archive, restore
from api.cli_database import DatabaseUrl, DataDir, console, data_dir_of, resolve_database, with_connection
from api.cluster_cli import cluster_app
from eventstore.dburl import DATABASE_URL_ENV, asyncpg_dsn

if TYPE_CHECKING:
    import asyncpg

    from eventstore.archive_file import ArchiveSource

app = typer.Typer(no_args_is_help=True, help="lockledger: leases with fencing tokens, on an event log.")


class LogLevelName(enum.StrEnum):
    """The levels ``--log-level`` accepts (a typo is refused by the option, not found at start)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


LogLevel = Annotated[
    LogLevelName,
    typer.Option(
        case_sensitive=False,
        envvar="LOCKLEDGER_LOG_LEVEL",
        help="Log level of every logger, structlog's and the standard library's (uvicorn's too): debug, info,"
        " warning, error, critical.",
    ),
]


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While a command runs (serve, reaper, psql), SIGTERM ends the process by SystemExit (status 143, as
    a shell reports a death by SIGTERM) instead of by the signal's default action.

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
    from migrations.upgrade import upgrade

    upgrade(url)
    console.print("[green]schema migrated to head[/green]")


# uvicorn without per-request work the service does not need: access lines (structlog and /metrics cover
# it), its own logging set-up (service/logs.py configures every logger, uvicorn's too), proxy header
# rewriting (no proxy in front by default), Server and Date headers; and httptools guarded against slow
# and hostile clients (api/http_protocol.py: deadlines for request heads and bodies and for writes that
# do not drain, a connection cap below the open-file limit, a cap on unfinished heads, problem+json for
# malformed requests), which also ends waiting acquires when a graceful shutdown begins.
_UVICORN_OPTIONS: dict[str, Any] = {
    "http": "api.http_protocol:GuardedHttpToolsProtocol",
    "access_log": False,
    "log_config": None,
    "proxy_headers": False,
    "server_header": False,
    "date_header": False,
}


APP_FACTORY = "api.app:create_app"


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="LOCKLEDGER_PORT", help="TCP port.")] = 8000,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
    migrate: Annotated[
        bool | None, typer.Option(help="Migrate before serving (default: only for the embedded server).")
    ] = None,
    reaper: Annotated[
        bool, typer.Option(envvar="LOCKLEDGER_REAPER_ENABLED", help="Run the reaper inside the server.")
    ] = True,
    log_level: LogLevel = LogLevelName.INFO,
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
    app_factory: Annotated[
        str,
        typer.Option(
            hidden=True,
            help="module:function building the app from Settings (a benchmark serves its own variant).",
        ),
    ] = APP_FACTORY,
) -> None:
    """Serve the HTTP API (and the reaper). Without a database URL, an embedded PostgreSQL is started."""

    from service.logs import configure_logging

    configure_logging(log_level.value)
    # The port first: when it is taken, nothing else (PostgreSQL, migrations, the reaper) should start.
    port = _claim_port(host, port)

    from uvicorn.importer import import_from_string

    from service.config import Settings

    create_app = import_from_string(app_factory)
    url, embedded = resolve_database(database_url, data_dir, migrate=False)
    if migrate if migrate is not None else embedded:
        _migrate(url)
    settings = Settings(database_url=url, reaper_enabled=reaper, dev_mode=dev)
    base = f"http://{host}:{port}"
    console.print(f"[bold]lockledger[/bold] serving on {base}")
    console.print(f"  Dashboard:             {base}/")
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
            uvicorn.run(
                create_app(settings), host=host, port=port, log_level=log_level.value, **_UVICORN_OPTIONS
            )
        return
    from api.workers import Supervisor

    # Worker processes build their app from the environment; each runs a reaper (they share the work).
    os.environ[DATABASE_URL_ENV] = url
    os.environ["LOCKLEDGER_REAPER_ENABLED"] = "true" if reaper else "false"
    os.environ["LOCKLEDGER_DEV_MODE"] = "true" if dev else "false"
    config = uvicorn.Config(
        app_factory, factory=True, host=host, port=port, log_level=log_level.value, **_UVICORN_OPTIONS
    )
    try:
        status = Supervisor(config, workers).run()
    except OSError as error:  # taken since _claim_port looked
        _port_unusable(host, port, error)
    if status:
        raise typer.Exit(status)


def _claim_port(host: str, port: int) -> int:
    """Check that ``host:port`` can be served on (nothing listens there) and return the port (a free one
    for port 0); else say why in one line and exit with status 1."""
    from api.workers import claim_port

    try:
        return claim_port(host, port)
    except OSError as error:
        _port_unusable(host, port, error)


def _port_unusable(host: str, port: int, error: OSError) -> NoReturn:
    if error.errno == errno.EADDRINUSE:
        console.print(
            f"[red]port {port} on {host} is in use (another lockledger?); "
            "choose another with --port N or `make run PORT=N`[/red]"
        )
    else:
        console.print(f"[red]cannot serve on {host}:{port}: {error.strerror or error}[/red]")
    raise typer.Exit(1)


@app.command("reaper")
def run_reaper(
    database_url: DatabaseUrl = None, data_dir: DataDir = None, log_level: LogLevel = LogLevelName.INFO
) -> None:
    """Run a standalone reaper (several may run at once; they share the work).

    Without a database URL it uses the embedded PostgreSQL, as the other commands do."""
    from service.composition import reaper_on_pool
    from service.config import Settings
    from service.database import create_pool
    from service.logs import configure_logging
    from service.outage import OutageWatch

    configure_logging(log_level.value)

    async def main(url: str) -> signal.Signals | None:
        settings = Settings(database_url=url)
        pool = await create_pool(settings)
        outage_watch = OutageWatch.for_settings(pool, settings)
        reaper = reaper_on_pool(pool, settings, outage_watch=outage_watch)
        stopped_by = _stop_on_signals(reaper.stop, outage_watch.stop)
        console.print(f"reaper {reaper.reaper_id} running; Ctrl-C to stop")
        beacon = asyncio.create_task(outage_watch.run())
        try:
            await reaper.run()
        finally:
            outage_watch.stop()
            await beacon
            await pool.close()
        return stopped_by[0] if stopped_by else None

    with _sigterm_unwinds():
        url, _ = resolve_database(database_url, data_dir)
        try:
            stopped_by = asyncio.run(main(url))
        except asyncio.CancelledError:  # a second signal: stopped without waiting for the pass to end
            raise SystemExit(128 + signal.SIGINT) from None
    if stopped_by == signal.SIGTERM:
        raise SystemExit(128 + signal.SIGTERM)


def _stop_on_signals(*stops: Callable[[], None]) -> list[signal.Signals]:
    """Make SIGINT and SIGTERM ask the running loop's workers to stop after their current pass; a second
    signal cancels the main task instead. Returns the list the first signal is recorded in.

    A stop the workers see beats a cancellation: one that lands as a timeout expires can be swallowed
    on Python 3.11 (``asyncio.wait_for``), and the process then runs on after Ctrl-C."""
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    received: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        if received and main_task is not None:
            main_task.cancel()
            return
        received.append(signum)
        for stop in stops:
            stop()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    return received


@app.command()
def migrate(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Create or upgrade the schema (tables, triggers, the service role's grants)."""
    url, _ = resolve_database(database_url, data_dir, migrate=False)
    _migrate(url)


@app.command()
def rebuild(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Rebuild what is derived from the event log: the lock_state projection, the indexes replay
    reads, and holding_periods (beside the live table, which serves until the switch; run as the schema
    owner)."""

    from projections.holding_periods import HOLDING_PERIODS
    from projections.projection_rebuild import rebuild_projection
    from projections.rebuild import rebuild_lock_state, rebuild_replay_indexes

    url, _ = resolve_database(database_url, data_dir)

    rows = asyncio.run(with_connection(url, rebuild_lock_state))
    console.print(f"[green]lock_state rebuilt from the log: {rows} resources[/green]")
    indexes = asyncio.run(with_connection(url, rebuild_replay_indexes))
    console.print(f"[green]replay indexes rebuilt from the log: {', '.join(indexes)}[/green]")
    switched = asyncio.run(
        with_connection(url, functools.partial(rebuild_projection, projection=HOLDING_PERIODS))
    )
    console.print(f"[green]holding_periods rebuilt from the log and switched to (at {switched.lo})[/green]")


ArchivesDir = Annotated[
    Path | None,
    typer.Option(
        "--archives",
        envvar="LOCKLEDGER_ARCHIVE_DIR",
        file_okay=False,
        help="Directory of the archive files (`lockledger archive`): verify through them into the live log.",
    ),
]


async def _archive_sources(
    conn: asyncpg.Connection, directory: Path | None
) -> tuple[list[ArchiveSource], int]:
    """The archive files to walk before the live log (each with the digest the catalog recorded), and
    how many archived partitions are left out because no directory was given."""
    from eventstore.archive import catalog
    from eventstore.archive_file import ArchiveSource

    archived = [record for record in await catalog(conn) if record.archived]
    if directory is None:
        return [], len(archived)
    return [ArchiveSource(directory / r.file_name, r.content_sha256) for r in archived], 0


async def _all_archive_sources(conn: asyncpg.Connection, directory: Path | None) -> list[ArchiveSource]:
    """Every archive file, for a digest, which must count every event: exit 2 when they are not given."""
    sources, left_out = await _archive_sources(conn, directory)
    if left_out:
        console.print(f"[red]{left_out} partition(s) of the log are archived: pass --archives DIR[/red]")
        raise typer.Exit(2)
    return sources


@app.command()
def verify(
    digest: Annotated[
        str | None,
        typer.Option(
            help="A digest from `lockledger audit digest`: also prove that nothing at or before its position"
            " was altered, inserted or removed (whole streams and streams' newest events included)."
        ),
    ] = None,
    archives: ArchivesDir = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Recompute every stream's hash chain; exit 1 and name the first broken link if any. With --digest,
    also prove the log up to the digest's position unchanged, or exit 1 naming what differs. With
    --archives, the chains run through the archive files (each checked against its recorded digest)."""

    from eventstore.archive_file import ArchiveCorrupt, walk_archive
    from eventstore.verify import ChainWalk, verify_chains

    if digest is not None:
        _verify_digest(digest, archives, database_url, data_dir)
    url, _ = resolve_database(database_url, data_dir)

    async def work(conn: asyncpg.Connection) -> Any:
        sources, left_out = await _archive_sources(conn, archives)
        walk = ChainWalk(anchor=left_out > 0)
        progress = lambda n: console.print(f"  {n:,} events verified")  # noqa: E731
        for source in sources:
            console.print(f"reading {escape(str(source.path))}")
            if (broken := await asyncio.to_thread(walk_archive, source, walk, progress)) is not None:
                return walk.report(broken), left_out
        return await verify_chains(conn, progress=progress, walk=walk), left_out

    try:
        report, left_out = asyncio.run(with_connection(url, work))
    except (ArchiveCorrupt, FileNotFoundError) as error:
        console.print(f"[red]ARCHIVE: {escape(str(error))}[/red]")
        sys.exit(1)
    if report.broken:
        link = report.broken
        console.print(f"[red]BROKEN: stream {link.stream_id} version {link.version}: {link.reason}[/red]")
        sys.exit(1)
    console.print(f"[green]OK: {report.events:,} events in {report.streams:,} streams, chains intact[/green]")
    if left_out:
        console.print(
            f"[yellow]{left_out} archived partition(s) not read: {report.anchored:,} stream(s) were checked"
            " from their first live event on. Pass --archives DIR to check their links to the archives"
            " too.[/yellow]"
        )
    sys.exit(0)


def _verify_digest(
    text: str, archives: Path | None, database_url: str | None, data_dir: Path | None
) -> NoReturn:
    """`verify --digest`: exit 0 when the log up to the digest's position is unchanged, else 1 naming
    every difference found."""
    from eventstore.archive_file import ArchiveCorrupt
    from eventstore.digest import Digest, verify_digest

    try:
        expected = Digest.parse(text)
    except ValueError as error:
        console.print(f"[red]{escape(str(error))}[/red]")
        raise typer.Exit(2) from None
    url, _ = resolve_database(database_url, data_dir)

    async def work(conn: asyncpg.Connection) -> Any:
        sources = await _all_archive_sources(conn, archives)
        return await verify_digest(
            conn, expected, progress=lambda n: console.print(f"  {n:,} events verified"), archives=sources
        )

    try:
        report = asyncio.run(with_connection(url, work))
    except (ArchiveCorrupt, FileNotFoundError) as error:
        console.print(f"[red]ARCHIVE: {escape(str(error))}[/red]")
        sys.exit(1)
    if not report.ok:
        console.print(f"[red]CHANGED: the log up to position {expected.position} differs:[/red]")
        for finding in report.findings():
            console.print(f"[red]  - {escape(finding)}[/red]")
        sys.exit(1)
    console.print(
        f"[green]OK: the log up to position {expected.position} is unchanged ({expected.events:,} events in"
        f" {expected.streams:,} streams; {report.chains.events:,} events in all, chains intact)[/green]"
    )
    sys.exit(0)


audit_app = typer.Typer(no_args_is_help=True, help="Audit: a log digest to keep outside the system.")
app.add_typer(audit_app, name="audit")


@audit_app.command("digest")
def audit_digest(
    position: Annotated[
        int | None, typer.Option(min=0, help="Cover the log up to this global position (default: newest).")
    ] = None,
    archives: ArchivesDir = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Print a digest of every event up to a position (the value alone on stdout). Keep it outside the
    system; `lockledger verify --digest` later proves the log up to there unchanged. Once partitions are
    archived, --archives names their files: the digest covers their events as it did before."""
    from eventstore.archive_file import ArchiveCorrupt
    from eventstore.digest import PositionBeyondLog, compute_digest

    url, _ = resolve_database(database_url, data_dir)

    async def work(conn: asyncpg.Connection) -> Any:
        sources = await _all_archive_sources(conn, archives)
        return await compute_digest(
            conn, position, progress=lambda n: console.print(f"  {n:,} stream heads hashed"), archives=sources
        )

    try:
        found = asyncio.run(with_connection(url, work))
    except PositionBeyondLog as error:
        console.print(f"[red]{escape(str(error))}[/red]")
        raise typer.Exit(2) from None
    except (ArchiveCorrupt, FileNotFoundError) as error:
        console.print(f"[red]ARCHIVE: {escape(str(error))}[/red]")
        sys.exit(1)
    console.print(
        f"digest of the log up to position {found.position}: {found.events:,} events in"
        f" {found.streams:,} streams"
    )
    print(found)


app.command()(archive)
app.command()(restore)

tokens_app = typer.Typer(no_args_is_help=True, help="API tokens: create, list, revoke.")
app.add_typer(tokens_app, name="tokens")

# `lockledger cluster up|status|switchover|dsn|down` (api/cluster_cli.py): a local Patroni cluster.
app.add_typer(cluster_app, name="cluster")

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
    url, _ = resolve_database(database_url, data_dir)
    try:
        token = asyncio.run(with_connection(url, lambda conn: tokens.create(conn, name, chosen)))
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

    url, _ = resolve_database(database_url, data_dir)
    rows = asyncio.run(with_connection(url, lambda conn: tokens.list_all(conn, include_revoked=all_tokens)))
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

    url, _ = resolve_database(database_url, data_dir)
    count = asyncio.run(with_connection(url, lambda conn: tokens.revoke(conn, name)))
    if count == 0:
        console.print(f"[yellow]{name} has no live tokens[/yellow]")
        raise typer.Exit(1)
    console.print(f"[green]revoked {count} token(s) of {name}[/green]")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def psql(ctx: typer.Context, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Open psql on the database; arguments after the options go to psql.

    For example `lockledger psql -c 'select 1'`; psql's own --help and -V go after `--`.
    The embedded server gets the psql shipped with it; a database URL, the psql on PATH (else that one).
    """
    url, embedded = resolve_database(database_url, data_dir)
    program = None if embedded else shutil.which("psql")
    if program is None:
        from eventstore.embedded import psql_program

        program = str(psql_program())
    with _sigterm_unwinds():
        status = _run_in_foreground([program, "--dbname", asyncpg_dsn(url), *ctx.args])
    raise typer.Exit(status)


def _run_in_foreground(argv: list[str]) -> int:
    """Run an interactive program to its end and return its exit status (128 + N if signal N ended it).

    Ctrl-C is the program's (psql cancels the running query with it), so this process only waits
    meanwhile; a SIGTERM is passed on. Waiting, rather than exec-ing the program, keeps this process to
    let go of the embedded server afterwards."""
    process = subprocess.Popen(argv)

    def ignore(signum: int, frame: object) -> None:  # a handler, not SIG_IGN, which the child inherits
        pass

    def pass_on(signum: int, frame: object) -> None:
        process.send_signal(signum)

    previous = signal.signal(signal.SIGINT, ignore), signal.signal(signal.SIGTERM, pass_on)
    try:
        status = process.wait()
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    return 128 - status if status < 0 else status


@app.command("database-url")
def database_url_command(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Print the database URL, for other tools such as pg_dump.

    The URL given, or that of the embedded server running on the data directory.
    The latter is valid while that server runs (while `make run` or `lockledger serve` does).
    """
    if database_url:
        print(asyncpg_dsn(database_url))
        return
    from eventstore import embedded

    directory = data_dir_of(data_dir)
    found = embedded.running(directory)
    if found is None:
        console.print(
            f"[red]no embedded PostgreSQL is running in {escape(str(directory))}; `make run` (or `lockledger"
            " serve`) starts it, and `lockledger psql` opens psql on it either way[/red]"
        )
        raise typer.Exit(1)
    print(found.url())


if __name__ == "__main__":
    app()


def register(target: typer.Typer) -> None:
    """Add the server's commands and command groups to ``target``, the `lockledger` command of the SDK's
    distribution (lockledger/cli.py), which finds this function through the entry point group
    ``lockledger.cli`` (pyproject.toml), so that neither distribution imports the other."""
    target.registered_commands.extend(app.registered_commands)
    target.registered_groups.extend(app.registered_groups)
