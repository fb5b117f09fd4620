"""PostgreSQL frozen (SIGSTOP): commands fail fast with 503 and Retry-After, readiness says so, and the
service recovers on its own when the database returns, with no lease granted before the outage lost.

Needs the embedded test server (its processes are ours to freeze); skipped against an external one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

import httpx
import pytest

from lockledger import AsyncClient, BreakerConfig, CircuitBreaker, CircuitOpen, State, Unavailable
from service.database_guard import NOT_TRIED, STALLED
from tests.databases import TestDatabase
from tests.servers import ServerProcess, free_port, frozen

pytestmark = [pytest.mark.storage, pytest.mark.slow]


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

            async def attempt(name: str) -> tuple[int, str, str | None]:
                response = await http.post(f"/v1/locks/{unique_prefix}{name}/acquire", json={"owner": "bot2"})
                assert response.headers["content-type"].startswith("application/problem+json")
                return response.status_code, response.json()["detail"], response.headers.get("retry-after")

            with frozen(test_database.postgres_pid):
                first = await asyncio.gather(*(attempt(f"early{i}") for i in range(8)))
                # Answered within the client's 30 s (the database timeouts), not held by the outage.
                for status, _, retry_after in first:
                    assert status == 503
                    assert retry_after is not None
                later = [await attempt(f"late{i}") for i in range(10)]
                not_tried = [
                    detail for status, detail, _ in later if status == 503 and detail in (STALLED, NOT_TRIED)
                ]
                assert len(not_tried) >= 5, later  # the guard opened: no more waiting on a frozen database
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


def _state(breaker: CircuitBreaker) -> State:
    """The breaker's state now (a call, so the type checker does not carry an earlier answer over)."""
    return breaker.state


async def test_sdk_breaker_opens_and_a_stalled_lease_knows_it_is_lost(
    test_database: TestDatabase, unique_prefix: str
) -> None:
    """The outage drill through the SDK: while PostgreSQL is frozen the client's breaker opens and
    then refuses calls in well under 5 ms without I/O; a lease whose renewals stall sees `lost` before its
    server-side deadline; after SIGCONT half-open probes close the breaker and a lease granted before the
    outage is renewed."""
    if test_database.postgres_pid is None:
        pytest.skip("the database server is not ours to freeze")
    server = ServerProcess(test_database.url, free_port(), {})
    server.start()
    breaker = CircuitBreaker(
        BreakerConfig(
            minimum_number_of_calls=3,
            sliding_window_size=10,
            wait_duration_in_open=1.0,
            permitted_calls_in_half_open=2,
        )
    )
    try:
        async with AsyncClient(server.base_url, retry_attempts=1, breaker=breaker) as client:
            kept = await client.acquire(f"{unique_prefix}kept", "bot1", ttl=60)
            lost_at: list[datetime] = []
            stalled = client.lock(
                f"{unique_prefix}stalled", ttl=2.0, on_lost=lambda _: lost_at.append(datetime.now(UTC))
            )
            lease = await stalled.__aenter__()
            server_deadline = lease.expires_at
            with frozen(test_database.postgres_pid):
                outcomes = await asyncio.gather(
                    *(client.acquire(f"{unique_prefix}x{i}", "bot2") for i in range(4)),
                    return_exceptions=True,
                )
                assert all(isinstance(o, Unavailable | CircuitOpen) for o in outcomes), outcomes
                # By now the server's own guard answers 503 at once, so a half-open probe fails fast and
                # the client breaker is open again: keep calling until it refuses without I/O.
                for i in range(20):
                    try:
                        await client.acquire(f"{unique_prefix}probe{i}", "bot2")
                    except CircuitOpen:
                        break
                    except Unavailable:
                        continue
                assert _state(breaker) is State.OPEN
                for i in range(5):  # refused by the client's breaker, before any request goes out
                    with pytest.raises(CircuitOpen):
                        await client.acquire(f"{unique_prefix}y{i}", "bot2")
                await asyncio.wait_for(lease.lost.wait(), timeout=10)
                assert server_deadline is not None
                assert len(lost_at) == 1
                assert lost_at[0] < server_deadline, (lost_at, server_deadline)  # before anyone could take it
            await stalled.__aexit__(None, None, None)

            deadline = time.monotonic() + 20
            async with httpx.AsyncClient(base_url=server.base_url) as plain:  # the server's own guard closes
                for _ in range(60):
                    if (await plain.get("/readyz")).status_code == 200:
                        break
                    await asyncio.sleep(0.3)
            while _state(breaker) is not State.CLOSED and time.monotonic() < deadline:  # then the client's
                await asyncio.sleep(0.3)
                with contextlib.suppress(CircuitOpen, Unavailable):
                    await client.get_lock(f"{unique_prefix}kept")
            assert _state(breaker) is State.CLOSED
            renewed = await client.renew(f"{unique_prefix}kept", "bot1", kept.fencing_token)
            assert renewed.fencing_token == kept.fencing_token
    finally:
        server.stop()


async def test_a_lease_outlives_a_database_outage_longer_than_its_ttl(
    test_database: TestDatabase, unique_prefix: str
) -> None:
    """PostgreSQL frozen for longer than a lease: nobody else gets the lease meanwhile or afterwards, the
    reaper does not expire it, and the holder renews it with its token once the database is back. The
    history shows why: a LOCK_RENEWED by lockledger for the outage, no LOCK_EXPIRED."""
    if test_database.postgres_pid is None:
        pytest.skip("the database server is not ours to freeze")
    resource = f"{unique_prefix}held"
    server = ServerProcess(test_database.url, free_port(), {})
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as http:
            held = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": 5_000})
            assert held.status_code == 201
            token = held.json()["fencing_token"]
            with frozen(test_database.postgres_pid):
                await asyncio.sleep(7)  # past the lease's deadline, with nothing able to renew it
            renewed = None
            for _ in range(100):  # the first answers may be the guard's 503 while it closes again
                renewed = await http.post(
                    f"/v1/locks/{resource}/renew", json={"owner": "bot1", "fencing_token": token}
                )
                if renewed.status_code != 503:
                    break
                await asyncio.sleep(0.1)
            assert renewed is not None
            assert renewed.status_code == 200, renewed.text
            taken = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot2"})
            assert taken.status_code == 409, taken.text

            history = (await http.get(f"/v1/locks/{resource}/history")).json()["events"]
            types = [(event["type"], event["metadata"].get("command")) for event in history]
            assert ("LOCK_RENEWED", "extend") in types, types
            assert all(kind != "LOCK_EXPIRED" for kind, _ in types), types
    finally:
        server.stop()
