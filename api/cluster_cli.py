"""`lockledger cluster`: a local PostgreSQL HA cluster (etcd and Patroni) in one command.

A thin layer over ``eventstore.cluster.LocalCluster``: up, status, switchover, dsn, down. Messages go to
stderr and the URL ``up`` and ``dsn`` print to stdout, so ``export LOCKLEDGER_DATABASE_URL=$(lockledger
cluster dsn)`` works.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from eventstore.cluster import LocalCluster

cluster_app = typer.Typer(
    no_args_is_help=True,
    help="A local PostgreSQL HA cluster (Patroni, etcd): up, status, switchover, dsn, down.",
)
console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True, highlight=False)

ClusterDir = Annotated[
    Path | None,
    typer.Option(
        "--dir",
        envvar="LOCKLEDGER_CLUSTER_DIR",
        show_default="a source checkout's .lockledger/cluster, else the user data directory's cluster",
        help="Directory of the cluster: its configuration, data, logs and pid files.",
    ),
]


def _cluster(directory: Path | None) -> LocalCluster:
    from eventstore.cluster import LocalCluster, default_cluster_dir

    return LocalCluster(directory or default_cluster_dir())


def _fail(error: Exception) -> typer.Exit:
    console.print(f"[red]{escape(str(error))}[/red]")
    return typer.Exit(1)


@cluster_app.command("up")
def up(
    nodes: Annotated[int, typer.Option(min=2, max=9, help="PostgreSQL nodes (3 survive a failover).")] = 3,
    etcd: Annotated[int, typer.Option(help="etcd members: 1, 3 or 5.")] = 1,
    directory: ClusterDir = None,
    database: Annotated[str, typer.Option(help="Database to create on the cluster.")] = "lockledger",
    migrate: Annotated[bool, typer.Option(help="Migrate the database to the schema's head.")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a leader and a sync standby.")] = 120,
) -> None:
    """Start etcd and a Patroni-managed PostgreSQL per node (again, with its data, if DIR has one).

    Waits for a leader and a synchronous standby, creates and migrates the database, and prints the
    URL to use as LOCKLEDGER_DATABASE_URL."""
    from eventstore.cluster import ClusterError

    cluster = _cluster(directory)
    again = cluster.exists()
    if nodes == 2 and not again:
        console.print(
            "[yellow]two nodes: after losing the primary, the promoted node has no synchronous standby"
            " and every commit waits until the other returns (three survive a failover)[/yellow]"
        )
    verb = "starting again" if again else "starting"
    console.print(f"{verb} a cluster of {nodes} nodes in {escape(str(cluster.directory))} ...")
    began = time.monotonic()
    try:
        state = cluster.up(nodes, etcd_members=etcd, timeout=timeout)
        url = cluster.create_database(database)
    except (ClusterError, ValueError) as error:
        raise _fail(error) from None
    if migrate:
        from migrations.upgrade import upgrade

        upgrade(url)
    console.print(
        f"[green]leader {state.leader}, synchronous standby {', '.join(state.sync_standbys)}"
        f" ({time.monotonic() - began:.0f} s)[/green]; `lockledger cluster status` shows more,"
        " `lockledger cluster down` stops it (data kept)"
    )
    where = "" if directory is None else f" --dir {escape(str(cluster.directory))}"
    console.print(f"use it with: export LOCKLEDGER_DATABASE_URL=$(lockledger cluster dsn{where})")
    out.print(url)


@cluster_app.command("status")
def status(directory: ClusterDir = None) -> None:
    """Leader, synchronous standby, and each member's state, timeline and lag."""
    from eventstore.cluster import ClusterError

    cluster = _cluster(directory)
    try:
        state = cluster.status()
    except ClusterError as error:
        raise _fail(error) from None
    table = Table("member", "role", "state", "address", "timeline", "lag (bytes)")
    for member in state.members:
        table.add_row(
            member.name,
            member.role,
            member.state,
            f"{member.host}:{member.port}",
            "" if member.timeline is None else str(member.timeline),
            "" if member.lag is None else str(member.lag),
        )
    out.print(table)
    standbys = ", ".join(state.sync_standbys) or "none"
    out.print(f"leader: {state.leader or 'none'}   synchronous standby: {standbys}")
    if not state.ready():
        console.print("[yellow]not ready: commits wait until a leader has a synchronous standby[/yellow]")
        raise typer.Exit(1)


@cluster_app.command("switchover")
def switchover(
    candidate: Annotated[
        str | None, typer.Option(help="The new leader: a synchronous standby (default: the first).")
    ] = None,
    directory: ClusterDir = None,
) -> None:
    """Hand the primary over to a synchronous standby; wait until it leads with a standby."""
    from eventstore.cluster import ClusterError

    cluster = _cluster(directory)
    try:
        before = cluster.status().leader
        state = cluster.switchover(candidate)
    except ClusterError as error:
        raise _fail(error) from None
    console.print(
        f"[green]leader {before} → {state.leader}, synchronous standby"
        f" {', '.join(state.sync_standbys)}[/green]"
    )


@cluster_app.command("dsn")
def dsn(
    directory: ClusterDir = None,
    database: Annotated[str, typer.Option(help="Database name.")] = "lockledger",
    read: Annotated[bool, typer.Option("--read", help="The URL that prefers a standby.")] = False,
) -> None:
    """Print the cluster's multi-host URL (the primary, or with --read a standby)."""
    from eventstore.cluster import ClusterError

    cluster = _cluster(directory)
    try:
        out.print(cluster.read_dsn(database) if read else cluster.dsn(database))
    except ClusterError as error:
        raise _fail(error) from None


@cluster_app.command("down")
def down(
    directory: ClusterDir = None,
    purge: Annotated[bool, typer.Option(help="Remove the directory too: every node's data.")] = False,
) -> None:
    """Stop every process of the cluster (Patroni, PostgreSQL, etcd); data kept unless --purge."""
    from eventstore.cluster import ClusterError

    cluster = _cluster(directory)
    if not cluster.exists():
        console.print(f"no cluster in {escape(str(cluster.directory))}")
        return
    try:
        stopped = cluster.down(purge=purge)
    except ClusterError as error:
        raise _fail(error) from None
    kept = "removed its directory" if purge else f"data kept in {escape(str(cluster.directory))}"
    console.print(f"[green]stopped {len(stopped)} processes[/green]; {kept}")
