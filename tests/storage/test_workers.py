"""`lockledger serve --workers N`: each worker accepts on its own SO_REUSEPORT socket, so a burst of
connections is spread over all of them; a port already served is refused; a worker that dies is replaced;
SIGTERM stops them all. Real processes, real sockets, a real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psutil
import pytest

if TYPE_CHECKING:
    from tests.conftest import ServerProcess, free_port
else:
    # pytest imports the rootdir conftest as the top-level module ``conftest`` (tests/ has no __init__.py).
    from conftest import ServerProcess, free_port

pytestmark = pytest.mark.storage

BURST = 64


def _workers(server: ServerProcess) -> list[psutil.Process]:
    assert server.process is not None
    children = psutil.Process(server.process.pid).children()
    return [child for child in children if "spawn_main" in " ".join(child.cmdline())]


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
        [sys.executable, "-m", "lockledger", "serve", "--port", str(two_workers.port), "--workers", "2"],
        env={**os.environ, "LOCKLEDGER_DATABASE_URL": database_url, "LOCKLEDGER_DEV_MODE": "true"},
        capture_output=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert b"Address already in use" in second.stdout + second.stderr


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
