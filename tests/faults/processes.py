"""The service processes a fault scenario starts, kills and restarts: `lockledger serve` and a standalone
`lockledger reaper`.

``FaultServer`` is the shared ``ServerProcess`` that keeps its stderr in a file, so a scenario whose server
fails to come back can say why; ``ReaperProcess`` is the reaper as an operator runs it beside the servers.
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
from typing import IO

import httpx

from tests.conftest import ServerProcess

# Servers started by tests run without authentication (the dev-mode switch of the auth work); harmless
# where the setting does not exist.
DEV_ENV = {"LOCKLEDGER_DEV_MODE": "true"}


def _log_tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class FaultServer(ServerProcess):
    """A `lockledger serve` subprocess on 127.0.0.1 in dev mode, restartable after SIGKILL."""

    log_path: Path | None = None
    starts: int = 0
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, timeout_s: float = 30.0) -> None:
        env = {**os.environ, "LOCKLEDGER_DATABASE_URL": self.database_url, **DEV_ENV, **self.env_overrides}
        if self._log is None and self.log_path is not None:
            self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lockledger", "serve", "--port", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self._log or subprocess.DEVNULL,
        )
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"lockledger serve exited with {self.process.returncode}\n{_log_tail(self.log_path)}"
                )
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"lockledger serve did not become ready\n{_log_tail(self.log_path)}")

    def close(self) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None


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
                [sys.executable, "-m", "lockledger", "reaper"], env=env, stdout=log, stderr=log
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
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    @property
    def reaper_ids(self) -> set[str]:
        """The ids the reapers wrote into LOCK_EXPIRED metadata (``service.reaper.default_reaper_id``)."""
        return {f"{socket.gethostname()}:{pid}" for pid in self.pids}


# What the ``start_server`` and ``start_reaper`` fixtures (conftest.py) hand a scenario.
ServerFactory = Callable[..., FaultServer]  # (database_url, env overrides=None)
ReaperFactory = Callable[[str], ReaperProcess]  # (database_url)
