"""Acquires that wait for a held lock (``wait_ms``; service/waiters.py), on a real PostgreSQL: over HTTP,
across a graceful shutdown and through a database outage. How waits behave (woken by a release here or
elsewhere, by a lapsed lease, in arrival order, never for a caller that has gone, a crowd of waiters in
two services on the fakes and on PostgreSQL) is tested in tests/service/test_waiting_acquires.py."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from domain.commands import Acquire
from domain.resource import TtlBounds
from service.composition import lock_service_on_pool
from service.database_guard import UNREACHABLE
from service.errors import Unavailable
from service.lock_service import CommandContext, LockService
from tests.assertions import assert_problem, granted
from tests.databases import TestDatabase
from tests.servers import ServerProcess, frozen, running_server

pytestmark = pytest.mark.storage

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)
# Far above what any wait below needs, so a missed wake fails the test instead of hanging the suite.
GUARD_S = 20.0


@pytest.fixture
async def service(service_pool: asyncpg.Pool) -> AsyncIterator[LockService]:
    """A service of its own (its own memory and waiters), as each server process has. Its follower looks
    only once a minute, so what wakes its waiters within a test is this service's own commits."""
    svc = lock_service_on_pool(service_pool, BOUNDS, wait_poll_s=60)
    yield svc
    await svc.close()


async def _take(service: LockService, resource: str, owner: str, ttl_ms: int = 30_000) -> int:
    result = await service.execute(Acquire(resource, owner, ttl_ms), CommandContext())
    return granted(result).fencing_token


# --- over HTTP ---------------------------------------------------------------------------------------


async def _waiting_behind_a_holder(
    client: httpx.AsyncClient, resource: str, wait_ms: int, settle_s: float
) -> tuple[int, asyncio.Task[httpx.Response]]:
    """``holder`` takes the lock; ``waiter``'s acquire is still waiting ``settle_s`` later. The holder's
    token, and the waiting request."""
    held = await client.post(f"/v1/locks/{resource}/acquire", json={"owner": "holder"})
    assert held.status_code == 201
    waiting = asyncio.create_task(
        client.post(f"/v1/locks/{resource}/acquire", json={"owner": "waiter", "wait_ms": wait_ms})
    )
    await asyncio.sleep(settle_s)
    assert not waiting.done()
    return held.json()["fencing_token"], waiting


async def test_http_acquire_waits_for_the_release(http: httpx.AsyncClient, resource: str) -> None:
    token, waiting = await _waiting_behind_a_holder(http, resource, 10_000, settle_s=0.3)
    released = await http.post(
        f"/v1/locks/{resource}/release", json={"owner": "holder", "fencing_token": token}
    )
    assert released.status_code == 200
    answer = await asyncio.wait_for(waiting, GUARD_S)
    assert answer.status_code == 201
    assert answer.json()["owner"] == "waiter"
    assert answer.json()["fencing_token"] > token


async def test_http_wait_that_runs_out_is_409(http: httpx.AsyncClient, resource: str) -> None:
    await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "holder"})
    started = time.monotonic()
    refused = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "waiter", "wait_ms": 500})
    assert time.monotonic() - started >= 0.5
    body = assert_problem(refused, 409, "lock_held")
    assert body["holder"] == "holder"


@pytest.mark.parametrize("wait_ms", [-1, "500", 1.5, True, 2**31 + 1])
async def test_http_refuses_a_malformed_wait(http: httpx.AsyncClient, resource: str, wait_ms: object) -> None:
    response = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "a", "wait_ms": wait_ms})
    body = assert_problem(response, 422, "validation_error")
    assert any("wait_ms" in str(error["loc"]) for error in body["errors"])


async def test_http_a_client_that_gave_up_waiting_takes_no_lock(
    server: ServerProcess, http: httpx.AsyncClient, resource: str
) -> None:
    held = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "holder"})
    token = held.json()["fencing_token"]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post(f"/v1/locks/{resource}/acquire", json={"owner": "ghost", "wait_ms": 10_000})
    # The impatient client's connection is closed; the release wakes its request, which must see that.
    await http.post(f"/v1/locks/{resource}/release", json={"owner": "holder", "fencing_token": token})
    await asyncio.sleep(0.5)
    state = (await http.get(f"/v1/locks/{resource}")).json()
    assert state["status"] == "free"
    assert state["queue"] == []  # it left the queue as it woke
    history = (await http.get(f"/v1/locks/{resource}/history")).json()["events"]
    assert [event["type"] for event in history] == ["LOCK_ACQUIRED", "LOCK_RELEASED"]


async def test_a_graceful_shutdown_answers_waiting_acquires_at_once(database_url: str, resource: str) -> None:
    """SIGTERM while an acquire waits for a held lock (30 s at most, the default): the wait ends with 503
    and Retry-After now, instead of holding the shutdown until the wait runs out."""
    with running_server(database_url, {}) as server:
        assert server.process is not None
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            _, waiting = await _waiting_behind_a_holder(client, resource, 25_000, settle_s=0.5)
            server.process.send_signal(signal.SIGTERM)
            # The wait has 25 s left and the guard is shorter: only the drain can answer in time.
            answer = await asyncio.wait_for(waiting, GUARD_S)
            assert_problem(answer, 503, "unavailable")
            assert answer.headers["retry-after"] == "1"
            assert "shutting down" in answer.json()["detail"]
        await asyncio.to_thread(server.process.wait, GUARD_S)


async def test_a_database_gone_during_the_wait_is_503_not_a_stale_holder(
    test_database: TestDatabase, service: LockService, resource: str
) -> None:
    """Frozen while the acquire waits: the deadline's decision cannot be made, and says so (the API
    answers these errors 503 ``unavailable``) rather than naming a holder from before the outage."""
    if test_database.postgres_pid is None:
        pytest.skip("the database server is not ours to freeze")
    await _take(service, resource, "holder")
    waiting = asyncio.create_task(
        service.execute(Acquire(resource, "waiter", 30_000, wait_ms=1_000), CommandContext())
    )
    await asyncio.sleep(0.3)
    with frozen(test_database.postgres_pid), pytest.raises((Unavailable, *UNREACHABLE)):
        await asyncio.wait_for(waiting, GUARD_S)
