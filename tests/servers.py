"""Servers under test: a `lockledger serve` subprocess, free ports, a frozen PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from domain.access import Role

# Mints an API token as an administrator would (the ``issue_token`` fixture).
IssueToken = Callable[[str, Role], Awaitable[str]]


@contextlib.contextmanager
def frozen(postmaster_pid: int) -> Iterator[None]:
    """SIGSTOP the whole cluster (postmaster and every backend); SIGCONT whatever happens."""
    postmaster = psutil.Process(postmaster_pid)
    processes = [postmaster, *postmaster.children(recursive=True)]
    for process in processes:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A `lockledger serve` subprocess on 127.0.0.1; restartable for crash tests."""

    database_url: str
    port: int
    env_overrides: dict[str, str]
    log_path: Path | None = None  # where its stdout and stderr go (appended across restarts); else discarded
    process: subprocess.Popen[bytes] | None = None
    workers: int = 1

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _failed(self, what: str) -> RuntimeError:
        tail = ""
        if self.log_path is not None and self.log_path.exists():
            tail = "\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        return RuntimeError(f"lockledger serve {what}{tail}")

    def start(self, timeout_s: float = 30.0) -> None:
        # Dev mode (no authentication) unless a test turns it off: most tests are about locks, not tokens.
        env = {
            **os.environ,
            "LOCKLEDGER_DATABASE_URL": self.database_url,
            "LOCKLEDGER_DEV_MODE": "true",
            **self.env_overrides,
        }
        log = self.log_path.open("ab") if self.log_path is not None else None
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "api.cli",
                    "serve",
                    "--port",
                    str(self.port),
                    "--workers",
                    str(self.workers),
                ],
                env=env,
                stdout=log or subprocess.DEVNULL,
                stderr=log or subprocess.DEVNULL,
            )
        finally:
            if log is not None:
                log.close()  # the child has its own descriptor
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failed(f"exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise self._failed("did not become ready")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, in-flight requests die mid-way."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, and SIGKILL if it has not ended within 10 s."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextlib.contextmanager
def running_server(database_url: str, env_overrides: dict[str, str]) -> Iterator[ServerProcess]:
    """A started server on a free port, stopped when the block ends, however it ends."""
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="lockledger-server-")) / f"serve-{port}.log"
    proc = ServerProcess(database_url, port, env_overrides, log_path=log_path)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(log_path.parent, ignore_errors=True)


# The shared server: its reaper every 100 ms; acquires wait at most 2 s (the fuzzer sends wait_ms of every
# size to locks it may hold already).
SERVER_SETTINGS = {"LOCKLEDGER_REAPER_INTERVAL_MS": "100", "LOCKLEDGER_MAX_WAIT_MS": "2000"}
# Authentication on, as in production; token lookups cached briefly so revocation tests need not wait 10 s.
AUTH_SERVER_SETTINGS = {
    "LOCKLEDGER_DEV_MODE": "false",
    "LOCKLEDGER_AUTH_CACHE_S": "0.5",
    "LOCKLEDGER_REAPER_ENABLED": "false",
    "LOCKLEDGER_MAX_WAIT_MS": "2000",
}
