"""The lockledger server under test: ``python -m api.cli serve`` as a subprocess of the bench.

Started with its reaper and authentication on (as in production: ``LOCKLEDGER_DEV_MODE=false`` whatever
the bench's own environment says; ready only once a request without a token is refused with 401) and the
no-op twin mounted (the benchmark's own app, ``bench.app``), so the real endpoints and the framework
ceiling run in the same processes. The bench knows its process id and samples it and its workers. A
caller may add to its environment (``env``: the reaper's settings, say) and set uvicorn's log level.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import psutil

from bench.app import FACTORY

_CHECKOUT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LockledgerServer:
    def __init__(
        self,
        database_url: str,
        workers: int,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        log_level: str | None = None,
    ) -> None:
        self.database_url = database_url
        self.workers = workers
        self.host = host
        self.env = dict(env or {})
        self.log_level = log_level
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="lockledger-bench-server-", suffix=".log")[1])

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout_s: float = 60.0) -> None:
        command = [
            sys.executable, "-m", "api.cli", "serve",
            "--host", self.host, "--port", str(self.port),
            "--workers", str(self.workers),
            "--database-url", self.database_url, "--no-migrate", "--app-factory", FACTORY,
            *(("--log-level", self.log_level) if self.log_level else ()),
        ]  # fmt: skip
        # The checkout on the path, so that the server (and each worker it spawns) imports ``bench.app``.
        env = {**os.environ, **self.env, "LOCKLEDGER_DEV_MODE": "false", "PYTHONPATH": str(_CHECKOUT)}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"lockledger serve exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if self._ready() and self._workers_up():
                if (status := self.anonymous_status()) != 401:
                    self.stop()
                    raise RuntimeError(f"authentication is off: a command without a token got {status}")
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"lockledger serve did not become ready in {timeout_s} s:\n{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/readyz", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def anonymous_status(self) -> int:
        """The status of an acquire sent without a token (401 with authentication on)."""
        request = urllib.request.Request(
            f"{self.base_url}/v1/locks/bench-auth-check/acquire",
            data=b'{"ttl_ms": 1000}',
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    def _workers_up(self) -> bool:
        """With several workers, every worker has answered readiness (each runs its own lifespan)."""
        if self.workers == 1:
            return True
        try:
            children = psutil.Process(self.pid).children()
        except psutil.Error:
            return False
        serving = [c for c in children if c.is_running() and "spawn_main" in " ".join(c.cmdline())]
        if len(serving) < self.workers:
            return False
        # Each worker opens its pool at startup; give them all time to finish, then check again.
        time.sleep(1.0)
        return all(self._ready() for _ in range(self.workers * 4))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def exited(self) -> int | None:
        """The exit status if the server is no longer running (it should run until ``stop()``)."""
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        died = process.poll() is not None
        if not died:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the session this bench started for it
                process.wait(5)
        self.process = None
        if not died:
            self.log_path.unlink(missing_ok=True)  # kept when the server died on its own
