"""PostgreSQL frozen (SIGSTOP): commands fail fast with 503 and Retry-After, readiness says so, and the
service recovers on its own when the database returns, with no lease granted before the outage lost.

Needs the embedded test server (its processes are ours to freeze); skipped against an external one.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psutil
import pytest

from tests.conftest import ServerProcess, TestDatabase, free_port

pytestmark = pytest.mark.storage


@contextmanager
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


async def test_frozen_database_fails_fast_and_recovers(
    test_database: TestDatabase, unique_prefix: str
) -> None:
    if test_database.postgres_pid is None:
        pytest.skip("the database server is not ours to freeze")
    server = ServerProcess(test_database.url, free_port(), {})
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as http:
            held = await http.post(
                f"/v1/locks/{unique_prefix}held/acquire", json={"owner": "bot1", "ttl_ms": 60_000}
            )
            assert held.status_code == 201
            token = held.json()["fencing_token"]

            async def attempt(name: str) -> tuple[int, float, str | None]:
                started = time.perf_counter()
                response = await http.post(f"/v1/locks/{unique_prefix}{name}/acquire", json={"owner": "bot2"})
                assert response.headers["content-type"].startswith("application/problem+json")
                return (
                    response.status_code,
                    time.perf_counter() - started,
                    response.headers.get("retry-after"),
                )

            with frozen(test_database.postgres_pid):
                first = await asyncio.gather(*(attempt(f"early{i}") for i in range(8)))
                for status, elapsed, retry_after in first:
                    assert status == 503
                    assert retry_after is not None
                    assert elapsed < 6.0  # bounded by the database timeouts (2 s each), not by the outage
                later = [await attempt(f"late{i}") for i in range(10)]
                fast = [elapsed for status, elapsed, _ in later if status == 503 and elapsed < 0.1]
                assert len(fast) >= 5, later  # the guard opened: no more waiting on a frozen database
                assert (await http.get("/readyz")).status_code == 503

            deadline = time.monotonic() + 20
            recovered = False
            while time.monotonic() < deadline and not recovered:
                response = await http.post(f"/v1/locks/{unique_prefix}after/acquire", json={"owner": "bot3"})
                recovered = response.status_code == 201
                if not recovered:
                    await asyncio.sleep(0.3)
            assert recovered, "the service did not recover after the database came back"
            assert (await http.get("/readyz")).status_code == 200

            renewed = await http.post(
                f"/v1/locks/{unique_prefix}held/renew", json={"owner": "bot1", "fencing_token": token}
            )
            assert renewed.status_code == 200, renewed.text  # the lease granted before the outage survived
    finally:
        server.stop()
