"""The service processes a fault scenario starts, kills and restarts: `lockledger serve` and a standalone
`lockledger reaper`.

Servers are the shared ``ServerProcess`` with a ``log_path``, so a scenario whose server fails to come back
can say why; ``ReaperProcess`` is the reaper as an operator runs it beside the servers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.servers import ServerProcess, stop_process


def _log_tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class ReaperProcess:
    """A standalone `lockledger reaper` subprocess; SIGKILL it and start another at will."""

    database_url: str
    log_path: Path
    env_overrides: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    pids: list[int] = field(default_factory=list)  # every process started, for matching reaper ids

    def start(self, timeout_s: float = 20.0) -> None:
        """Start a reaper and wait until it says it runs (its pool is connected by then)."""
        env = {**os.environ, "LOCKLEDGER_DATABASE_URL": self.database_url, **self.env_overrides}
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "api.cli", "reaper"], env=env, stdout=log, stderr=log
            )
        self.pids.append(self.process.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"lockledger reaper exited with {self.process.returncode}")
            with self.log_path.open("rb") as log:
                log.seek(offset)
                if b"running" in log.read():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"lockledger reaper did not start\n{_log_tail(self.log_path)}")

    def kill(self) -> None:
        """SIGKILL: a pass in progress dies with its transaction uncommitted."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        stop_process(self.process)

    @property
    def reaper_ids(self) -> set[str]:
        """The ids the reapers wrote into LOCK_EXPIRED metadata (``service.outage.instance_id``)."""
        return {f"{socket.gethostname()}:{pid}" for pid in self.pids}


# What the ``start_server`` and ``start_reaper`` fixtures (conftest.py) hand a scenario.
ServerFactory = Callable[..., ServerProcess]  # (database_url, env overrides=None)
ReaperFactory = Callable[[str], ReaperProcess]  # (database_url)
