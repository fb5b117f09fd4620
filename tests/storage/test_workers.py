"""`lockledger serve --workers N`: each worker accepts on its own SO_REUSEPORT socket, so a burst of
connections is spread over all of them; a port already served is refused; a worker that dies is replaced,
one that keeps dying is restarted after a pause while the others serve, and only when every worker keeps
failing to start does the server stop; SIGTERM stops them all, and a supervisor killed outright takes its
workers with it. Real processes, real sockets, a real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from api.workers import QUICK_DEATHS_TO_GIVE_UP, backoff_s
from tests.servers import ServerProcess, free_port, stop_process

pytestmark = [pytest.mark.storage, pytest.mark.slow]

BURST = 64


def _workers(server: ServerProcess) -> list[psutil.Process]:
    """The supervisor's worker processes that are running (not a dead one it has yet to reap)."""
    assert server.process is not None
    workers = []
    for child in psutil.Process(server.process.pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.Error:  # ended since it was listed
            continue
    return workers


def _listening(worker: psutil.Process, port: int) -> bool:
    try:
        return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in worker.net_connections())
    except psutil.Error:
        return False


def _wait_for_workers(server: ServerProcess, count: int, timeout_s: float = 30.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = _workers(server)
        if len(workers) == count and all(_listening(w, server.port) for w in workers):
            return workers
        time.sleep(0.1)
    raise AssertionError(f"{count} listening workers did not come up: {_workers(server)}")


@pytest.fixture
def two_workers(database_url: str) -> Iterator[ServerProcess]:
    server = ServerProcess(database_url, free_port(), {}, workers=2)
    server.start()
    try:
        _wait_for_workers(server, 2)
        yield server
    finally:
        server.stop()


async def _burst(port: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """BURST keep-alive connections opened at once, each answered once (200 from /readyz)."""

    async def one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: lockledger\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        return reader, writer

    return await asyncio.gather(*(one() for _ in range(BURST)))


def _connections_per_worker(server: ServerProcess) -> Counter[int]:
    held: Counter[int] = Counter()
    for worker in _workers(server):
        held[worker.pid] = sum(
            1
            for c in worker.net_connections()
            if c.laddr.port == server.port and c.status == psutil.CONN_ESTABLISHED
        )
    return held


def test_a_burst_of_connections_is_spread_over_the_workers(two_workers: ServerProcess) -> None:
    """uvicorn's shared socket gave one worker 63 of 64 such connections; the kernel's hash over two
    sockets gives each about half (fewer than 8 of 64 has a chance below 1e-10)."""

    async def rounds() -> list[Counter[int]]:
        seen = []
        for _ in range(3):
            connections = await _burst(two_workers.port)
            await asyncio.sleep(0.2)
            seen.append(await asyncio.to_thread(_connections_per_worker, two_workers))
            for _, writer in connections:
                writer.close()
            await asyncio.sleep(0.2)
        return seen

    for held in asyncio.run(rounds()):
        assert len(held) == 2, held
        assert sum(held.values()) == BURST, held
        assert min(held.values()) >= 8, held


def test_a_port_already_served_is_refused_not_shared(two_workers: ServerProcess, database_url: str) -> None:
    second = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--port", str(two_workers.port), "--workers", "2"],
        env={**os.environ, "LOCKLEDGER_DATABASE_URL": database_url, "LOCKLEDGER_DEV_MODE": "true"},
        capture_output=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert b"in use" in second.stdout + second.stderr


def test_a_dead_worker_is_replaced_and_sigterm_stops_them_all(two_workers: ServerProcess) -> None:
    first, other = _wait_for_workers(two_workers, 2)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    replaced = _wait_for_workers(two_workers, 2)
    assert first.pid not in {w.pid for w in replaced}
    assert other.pid in {w.pid for w in replaced}
    asyncio.run(_burst(two_workers.port))  # every connection, whichever worker it reached, answered

    two_workers.stop()
    assert two_workers.process is not None
    assert two_workers.process.returncode == 0
    for worker in replaced:
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


def _gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _healthy(server: ServerProcess) -> bool:
    """A fresh connection is answered by a worker."""
    return httpx.get(f"{server.base_url}/healthz", timeout=10).status_code == 200


def test_workers_end_when_the_supervisor_is_killed(database_url: str) -> None:
    """``kill -9`` of the supervisor: no worker goes on serving unsupervised, and the port can be served
    again without hunting them down."""
    server = ServerProcess(database_url, free_port(), {}, workers=2)
    server.start()
    workers = _wait_for_workers(server, 2)
    try:
        server.kill()
        _wait_until(lambda: all(_gone(w) for w in workers), f"workers outlived the supervisor: {workers}")
        again = ServerProcess(database_url, server.port, {}, workers=2)
        again.start()  # ready: the port was free
        again.stop()
    finally:
        for worker in workers:  # only if the test failed: leave nothing running
            if not _gone(worker):
                worker.kill()


def test_a_crash_looping_worker_does_not_stop_the_others(database_url: str, tmp_path: Path) -> None:
    """One worker dies as soon as it starts, again and again: the other keeps serving throughout, the
    supervisor keeps running and restarts it after growing pauses, and it serves again once it stays up."""
    server = ServerProcess(database_url, free_port(), {}, workers=2, log_path=tmp_path / "serve.log")
    server.start()
    try:
        steady, flaky = _wait_for_workers(server, 2)
        killed = {flaky.pid}
        flaky.kill()
        flaky.wait(10)
        for _ in range(QUICK_DEATHS_TO_GIVE_UP):  # as many quick deaths as stopped every worker before
            assert _healthy(server)
            _wait_until(
                lambda: any(w.pid not in killed | {steady.pid} for w in _workers(server)),
                "the dead worker was not started again",
            )
            restarted = next(w for w in _workers(server) if w.pid not in killed | {steady.pid})
            restarted.kill()  # before it could even start serving
            killed.add(restarted.pid)
            assert server.process is not None
            assert server.process.poll() is None, "the supervisor gave up on a single failing worker"
        assert _healthy(server)
        serving = _wait_for_workers(server, 2, timeout_s=30.0 + backoff_s(QUICK_DEATHS_TO_GIVE_UP + 1))
        assert steady.pid in {w.pid for w in serving}
        assert _healthy(server)
    finally:
        server.stop()
    assert server.process is not None
    assert server.process.returncode == 0
    assert "times in a row" in (tmp_path / "serve.log").read_text()


def test_the_server_stops_when_every_worker_keeps_failing_to_start(tmp_path: Path) -> None:
    """No database to reach: no worker can start, so the supervisor gives up with status 1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nowhere = f"postgresql://lockledger@127.0.0.1:{sock.getsockname()[1]}/lockledger"  # nothing listens
    result = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--port", str(free_port()), "--workers", "2"],
        env={**os.environ, "LOCKLEDGER_DATABASE_URL": nowhere, "LOCKLEDGER_DEV_MODE": "true"},
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert b"every worker keeps exiting" in result.stderr


_SUPERVISOR_SCRIPT = """
import multiprocessing, sys, time

from api import workers


def worker(disable):
    if disable == "kernel":
        workers._ask_kernel_for_sigterm_on_parent_death = lambda: None
    elif disable == "sentinel":
        workers._stop_when_gone = lambda supervisor: None
    workers.end_with_supervisor()
    print("watching", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=worker, args=(sys.argv[1],))
    process.start()
    print(process.pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize(
    "disabled",
    [
        pytest.param(
            "sentinel",
            id="kernel-signal-alone",
            marks=pytest.mark.skipif(sys.platform != "linux", reason="Linux only"),
        ),
        pytest.param("kernel", id="sentinel-thread-alone"),
    ],
)
def test_each_watch_alone_ends_a_worker_whose_supervisor_died(disabled: str, tmp_path: Path) -> None:
    """Either way of noticing the supervisor's death is enough by itself: the kernel's signal, and the
    thread on the parent sentinel (the one that works beyond Linux)."""
    script = tmp_path / "supervisor.py"
    script.write_text(_SUPERVISOR_SCRIPT)
    supervisor = subprocess.Popen(
        [sys.executable, str(script), disabled],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    worker: psutil.Process | None = None
    try:
        assert supervisor.stdout is not None
        worker = psutil.Process(int(supervisor.stdout.readline()))
        assert supervisor.stdout.readline() == b"watching\n"
        supervisor.kill()
        supervisor.wait(10)
        watched = worker
        _wait_until(lambda: _gone(watched), "the worker outlived its supervisor")
    finally:
        if worker is not None and not _gone(worker):
            worker.kill()
        stop_process(supervisor)
