"""`lockledger serve` without a database URL starts the embedded PostgreSQL, and stopping the service the
way an operator or a supervisor does (SIGTERM, Ctrl-C) stops that PostgreSQL too: no server is left
running on the data directory after the service is gone.

uvicorn ends a graceful shutdown by raising the signal that asked for it again; SIGTERM's default action
then killed the process before ``atexit`` ran, and the embedded server's handle is released there.
Each test starts a real `lockledger serve` on a data directory of its own (not a storage test: it never
uses the suite's database)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow


def _postgres_on(data_dir: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.info["name"] == "postgres" and str(data_dir) in cmdline:
            found.append(process)
    return found


def _serve_until_ready(data_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LOCKLEDGER_DATABASE_URL"}
    process = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--dev", "--no-reaper", "--port", str(port),
         "--data-dir", str(data_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"serve exited early: {process.stderr.read().decode() if process.stderr else ''}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError("serve was not ready within 60 s")


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_stopping_serve_stops_its_embedded_postgres(tmp_path: Path, stop: signal.Signals) -> None:
    data_dir = tmp_path / "pgdata"
    process, port = _serve_until_ready(data_dir)
    try:
        assert _postgres_on(data_dir), "the embedded PostgreSQL should run while serving"
        acquired = httpx.post(f"http://127.0.0.1:{port}/v1/locks/zone:A3/acquire", json={"owner": "agv-17"})
        assert acquired.status_code == 201
        process.send_signal(stop)
        process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _postgres_on(data_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _postgres_on(data_dir) == []
    finally:
        if process.poll() is None:
            process.kill()
        for leftover in _postgres_on(data_dir):
            leftover.kill()

    # and the lease taken before the stop is still there when the service comes back on the same data
    again, port = _serve_until_ready(data_dir)
    try:
        state = httpx.get(f"http://127.0.0.1:{port}/v1/locks/zone:A3").json()
        assert state["owner"] == "agv-17"
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(timeout=30)
        for leftover in _postgres_on(data_dir):
            leftover.kill()
