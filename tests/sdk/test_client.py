"""The SDK clients against the real server: typed results, typed errors, idempotent retries, the breaker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime

import httpx
import pytest

from lockledger import (
    AsyncClient,
    BreakerConfig,
    CircuitBreaker,
    CircuitOpen,
    Client,
    Forbidden,
    LeaseExpired,
    LockHeld,
    LockLedgerError,
    NotFound,
    NotHolder,
    State,
    Unauthorized,
    Unavailable,
    ValidationError,
)
from lockledger.client import LeaseInfo, LockInfo, Released
from lockledger.errors import IdempotencyKeyReused, error_from_response
from tests.servers import ServerProcess, free_port

pytestmark = pytest.mark.storage


class Faulty(httpx.AsyncBaseTransport):
    """Forwards to a real transport; can drop the first response or answer 503 once; counts attempts."""

    def __init__(self, *, drop_first: bool = False, unavailable_first: bool = False) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.drop_first = drop_first
        self.unavailable_first = unavailable_first
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        first = len(self.requests) == 1
        if first and self.unavailable_first:
            body = {"code": "unavailable", "status": 503, "detail": "try later"}
            return httpx.Response(503, json=body, headers={"Retry-After": "0"})
        response = await self.inner.handle_async_request(request)
        if first and self.drop_first:
            await response.aread()
            await response.aclose()
            raise httpx.ReadTimeout("response lost on the way back", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class Counting(httpx.BaseTransport):
    """Forwards to a real transport and counts the requests that reached it."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class SyncFaulty(httpx.BaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        response = self.inner.handle_request(request)
        if len(self.requests) == 1:
            response.read()
            response.close()
            raise httpx.ReadTimeout("response lost on the way back", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


async def test_every_method_round_trips_with_typed_results(server: ServerProcess, unique_prefix: str) -> None:
    resource = f"{unique_prefix}zone"
    async with AsyncClient(server.base_url) as client:
        assert await client.health() == {"status": "ok"}
        assert (await client.ready())["status"] == "ready"

        lease = await client.acquire(resource, "agv-1", ttl=5.0)
        assert isinstance(lease, LeaseInfo)
        assert (lease.resource, lease.owner, lease.ttl) == (resource, "agv-1", 5.0)
        assert isinstance(lease.expires_at, datetime)
        assert lease.expires_at.tzinfo is not None

        renewed = await client.renew(resource, "agv-1", lease.fencing_token, ttl=8.5)
        assert renewed.fencing_token == lease.fencing_token
        assert renewed.ttl == 8.5
        assert renewed.expires_at > lease.expires_at

        info = await client.get_lock(resource)
        assert isinstance(info, LockInfo)
        assert (info.status, info.owner, info.fencing_token) == ("held", "agv-1", lease.fencing_token)
        assert info.ttl == 8.5
        assert isinstance(info.updated_at, datetime)

        others = [f"{unique_prefix}p{i}" for i in range(3)]
        for other in others:
            await client.acquire(other, "agv-2")
        page = await client.list_locks(prefix=unique_prefix, limit=2)
        assert len(page.items) == 2
        assert page.next_cursor is not None
        every = [i.resource async for i in client.iter_locks(prefix=unique_prefix, limit=2)]
        assert sorted(every) == sorted([resource, *others])
        mine = await client.list_locks(holder="agv-1", prefix=unique_prefix)
        assert [i.resource for i in mine.items] == [resource]

        released = await client.release(resource, "agv-1", lease.fencing_token)
        assert released == Released(resource, "agv-1", lease.fencing_token, True)
        assert (await client.get_lock(resource)).status == "free"

        forced = await client.force_release(others[0], "operator cleared the zone")
        assert forced.released
        assert forced.owner == "agv-2"
        assert forced.reason == "operator cleared the zone"

        history = await client.history(resource)
        assert [e.type for e in history.events] == ["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"]
        assert isinstance(history.events[0].recorded_at, datetime)
        assert history.next_after_version is None
        tail = await client.history(resource, after_version=1, limit=1)
        assert [e.version for e in tail.events] == [2]
        assert tail.next_after_version == 2


async def test_problems_become_typed_exceptions(server: ServerProcess, unique_prefix: str) -> None:
    resource = f"{unique_prefix}zone"
    async with AsyncClient(server.base_url) as client:
        lease = await client.acquire(resource, "agv-1", ttl=1)
        with pytest.raises(LockHeld) as held:
            await client.acquire(resource, "agv-2")
        assert held.value.holder == "agv-1"
        assert held.value.fencing_token == lease.fencing_token
        assert held.value.expires_at == lease.expires_at
        assert (held.value.status, held.value.code) == (409, "lock_held")
        assert held.value.problem["resource"] == resource

        with pytest.raises(NotHolder):
            await client.renew(resource, "agv-2", lease.fencing_token)

        await asyncio.sleep(1.2)
        with pytest.raises(LeaseExpired) as expired:
            await client.renew(resource, "agv-1", lease.fencing_token)
        assert expired.value.status == 410
        assert expired.value.expired_at is not None

        with pytest.raises(ValidationError) as too_short:
            await client.acquire(resource, "agv-1", ttl=0.005)
        assert too_short.value.status == 422  # the server's bounds, not the SDK's
        with pytest.raises(ValidationError) as bad:
            await client.acquire("bad resource!", "agv-1")
        assert bad.value.status == 0  # refused before any request
        with pytest.raises(NotFound):
            await client.get_lock(f"{unique_prefix}never")


def test_error_mapping_without_a_body() -> None:
    request = httpx.Request("GET", "http://x/readyz")
    error = error_from_response(
        httpx.Response(503, text="<html>", headers={"Retry-After": "2"}, request=request)
    )
    assert isinstance(error, Unavailable)
    assert error.retry_after == 2.0
    assert isinstance(error_from_response(httpx.Response(404, request=request)), NotFound)


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (422, "idempotency_key_reused", IdempotencyKeyReused),
        (409, "conflict", LockLedgerError),
        (401, "unauthorized", Unauthorized),
        (403, "forbidden", Forbidden),
        (410, "lease_expired", LeaseExpired),
        (418, "something_new", LockLedgerError),
    ],
)
def test_problem_codes_map_to_exception_types(status: int, code: str, expected: type[Exception]) -> None:
    response = httpx.Response(
        status,
        json={"code": code, "status": status, "detail": "d"},
        headers={"Content-Type": "application/problem+json"},
        request=httpx.Request("POST", "http://x/v1/locks/a/acquire"),
    )
    error = error_from_response(response)
    assert type(error) is expected
    assert (error.status, error.code, error.problem["detail"]) == (status, code, "d")


async def test_lost_response_is_retried_under_one_idempotency_key(
    server: ServerProcess, unique_prefix: str
) -> None:
    resource = f"{unique_prefix}zone"
    transport = Faulty(drop_first=True)
    async with AsyncClient(server.base_url, transport=transport) as client:
        lease = await client.acquire(resource, "agv-1")  # executed, answer lost, retried: replayed
        keys = {r.headers["Idempotency-Key"] for r in transport.requests}
        assert len(transport.requests) == 2
        assert len(keys) == 1
        history = await client.history(resource)
    assert [e.type for e in history.events] == ["LOCK_ACQUIRED"]
    assert history.events[0].version == lease.fencing_token


async def test_503_is_retried_with_the_same_key(server: ServerProcess, unique_prefix: str) -> None:
    resource = f"{unique_prefix}zone"
    transport = Faulty(unavailable_first=True)
    async with AsyncClient(server.base_url, transport=transport) as client:
        lease = await client.acquire(resource, "agv-1")
        released = await client.release(resource, "agv-1", lease.fencing_token)
        history = await client.history(resource)
    assert released.released
    commands = [r for r in transport.requests if r.method == "POST"]
    assert len(commands) == 3
    assert commands[0].headers["Idempotency-Key"] == commands[1].headers["Idempotency-Key"]
    assert commands[2].headers["Idempotency-Key"] != commands[0].headers["Idempotency-Key"]
    assert [e.type for e in history.events] == ["LOCK_ACQUIRED", "LOCK_RELEASED"]


async def test_domain_errors_are_never_retried(server: ServerProcess, unique_prefix: str) -> None:
    resource = f"{unique_prefix}zone"
    transport = Faulty()
    async with AsyncClient(server.base_url, transport=transport) as client:
        await client.acquire(resource, "agv-1")
        with pytest.raises(LockHeld):
            await client.acquire(resource, "agv-2")
        with pytest.raises(NotHolder):
            await client.release(resource, "agv-2", 1)
        with pytest.raises(NotFound):
            await client.get_lock(f"{unique_prefix}never")
        assert len(transport.requests) == 4
        assert client.breaker.state is State.CLOSED  # 4xx answers count as a healthy server


async def test_breaker_opens_and_then_fails_fast_without_io() -> None:
    breaker = CircuitBreaker(
        BreakerConfig(minimum_number_of_calls=3, sliding_window_size=5, wait_duration_in_open=60)
    )
    transport = Faulty()
    async with AsyncClient(
        f"http://127.0.0.1:{free_port()}", breaker=breaker, transport=transport, retry_attempts=1
    ) as client:
        for _ in range(3):
            with pytest.raises(Unavailable):
                await client.health()
        sent = len(transport.requests)
        assert sent == 3
        assert breaker.state is State.OPEN
        for _ in range(5):
            with pytest.raises(CircuitOpen):
                await client.acquire("zone:A3", "agv-1")
        assert len(transport.requests) == sent  # refused before any request went out


async def test_retries_stop_at_the_attempt_bound() -> None:
    transport = Faulty()
    async with AsyncClient(
        f"http://127.0.0.1:{free_port()}", transport=transport, retry_attempts=3
    ) as client:
        with pytest.raises(Unavailable) as unavailable:
            await client.acquire("zone:A3", "agv-1")
    assert isinstance(unavailable.value.__cause__, httpx.ConnectError)
    assert len(transport.requests) == 3
    assert len({r.headers["Idempotency-Key"] for r in transport.requests}) == 1


def test_sync_client_round_trip_and_errors(server: ServerProcess, unique_prefix: str) -> None:
    resource = f"{unique_prefix}zone"
    transport = SyncFaulty()
    with Client(server.base_url, transport=transport) as client:
        assert client.health() == {"status": "ok"}  # its first response is dropped and retried
        assert client.ready()["status"] == "ready"
        lease = client.acquire(resource, "agv-1", ttl=4)
        assert isinstance(lease.expires_at, datetime)
        with pytest.raises(LockHeld) as held:
            client.acquire(resource, "agv-2")
        assert held.value.holder == "agv-1"
        renewed = client.renew(resource, "agv-1", lease.fencing_token)
        assert renewed.ttl == 4.0
        assert client.get_lock(resource).owner == "agv-1"
        assert [i.resource for i in client.iter_locks(prefix=unique_prefix, limit=1)] == [resource]
        assert client.list_locks(prefix=unique_prefix).next_cursor is None
        assert client.release(resource, "agv-1", lease.fencing_token).released
        with pytest.raises(NotHolder):
            client.release(resource, "agv-1", lease.fencing_token)
        assert not client.force_release(resource, "nothing to do").released
        with pytest.raises(NotFound):
            client.get_lock(f"{unique_prefix}never")
        events = [e.type for e in client.history(resource).events]
    assert events == ["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"]


def test_sync_breaker_fails_fast() -> None:
    breaker = CircuitBreaker(BreakerConfig(minimum_number_of_calls=2, sliding_window_size=2))
    transport = Counting()
    with Client(
        f"http://127.0.0.1:{free_port()}", breaker=breaker, retry_attempts=2, transport=transport
    ) as client:
        with pytest.raises(Unavailable):
            client.health()
        sent = len(transport.requests)
        assert sent == 2
        for _ in range(5):
            with pytest.raises(CircuitOpen):
                client.health()
        assert len(transport.requests) == sent  # refused before any request went out


def _nothing_listening(unavailable: Unavailable, path: str) -> None:
    """What a caller sees when no server answered: the SDK's own error, with httpx's as its cause."""
    assert unavailable.status == 0
    assert unavailable.code == "unavailable"
    assert isinstance(unavailable.__cause__, httpx.ConnectError)
    assert path in unavailable.detail
    assert "ConnectError" in unavailable.detail


async def test_async_transport_errors_are_unavailable_after_the_retries() -> None:
    transport = Faulty()
    port = free_port()  # bound once and released: nothing listens on it
    async with AsyncClient(f"http://127.0.0.1:{port}", transport=transport, retry_attempts=2) as client:
        calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("/v1/locks/zone:A3/acquire", lambda: client.acquire("zone:A3", "agv-1")),
            ("/v1/locks/zone:A3/renew", lambda: client.renew("zone:A3", "agv-1", 1)),
            ("/v1/locks/zone:A3/release", lambda: client.release("zone:A3", "agv-1", 1)),
            ("/v1/locks/zone:A3/force-release", lambda: client.force_release("zone:A3", "why")),
            ("/v1/locks/zone:A3", lambda: client.get_lock("zone:A3")),
            ("/v1/locks", lambda: client.list_locks()),
            ("/v1/locks/zone:A3/history", lambda: client.history("zone:A3")),
            ("/healthz", lambda: client.health()),
            ("/readyz", lambda: client.ready()),
        ]
        for path, call in calls:
            client.breaker.reset()  # each call its own retries, not the breaker's fast refusal
            sent = len(transport.requests)
            with pytest.raises(Unavailable) as unavailable:
                await call()
            _nothing_listening(unavailable.value, path)
            assert len(transport.requests) - sent == 2  # retried first


def test_sync_transport_errors_are_unavailable_after_the_retries() -> None:
    port = free_port()
    with Client(f"http://127.0.0.1:{port}", retry_attempts=2) as client:
        calls: list[tuple[str, Callable[[], object]]] = [
            ("/v1/locks/zone:A3/acquire", lambda: client.acquire("zone:A3", "agv-1")),
            ("/v1/locks/zone:A3/renew", lambda: client.renew("zone:A3", "agv-1", 1)),
            ("/v1/locks/zone:A3/release", lambda: client.release("zone:A3", "agv-1", 1)),
            ("/v1/locks", lambda: client.list_locks()),
            ("/healthz", lambda: client.health()),
        ]
        for path, call in calls:
            client.breaker.reset()
            with pytest.raises(Unavailable) as unavailable:
                call()
            _nothing_listening(unavailable.value, path)


async def test_retry_after_is_honoured_as_the_wait(server: ServerProcess, unique_prefix: str) -> None:
    class SlowDown(Faulty):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            if len(self.requests) == 1:
                body = {"code": "unavailable", "status": 503, "detail": "database is not answering"}
                return httpx.Response(503, json=body, headers={"Retry-After": "1"})
            return await self.inner.handle_async_request(request)

    transport = SlowDown()
    async with AsyncClient(server.base_url, transport=transport) as client:
        started = time.monotonic()
        await client.acquire(f"{unique_prefix}zone", "agv-1")
        assert time.monotonic() - started >= 1.0
    assert len(transport.requests) == 2


def test_importing_the_sdk_pulls_in_no_server_code() -> None:
    code = (
        "import sys, lockledger\n"
        "bad = {'api', 'service', 'projections', 'eventstore', 'domain'}\n"
        "bad |= {'fastapi', 'asyncpg', 'sqlalchemy'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


async def test_a_waiting_acquire_cut_by_a_restart_is_retried_and_granted(
    database_url: str, unique_prefix: str
) -> None:
    """SIGTERM while the SDK's acquire waits on the server: the server answers 503 at once, and the SDK
    retries under the same key (its retry time grows by the wait, here 1 s + 20 s) until the restarted
    server grants the lease once the holder releases."""
    resource = f"{unique_prefix}dock"
    server = ServerProcess(database_url, free_port(), {})
    server.start()
    try:
        async with AsyncClient(server.base_url, retry_timeout=1.0) as client:
            held = await client.acquire(resource, "holder", ttl=60)
            waiting = asyncio.create_task(client.acquire(resource, "waiter", wait=20))
            await asyncio.sleep(1.5)  # past the plain retry time
            assert not waiting.done()
            server.stop()  # SIGTERM: the waiting acquire is answered 503, and the client retries
            await asyncio.to_thread(server.start)
            await client.release(resource, "holder", held.fencing_token)
            lease = await asyncio.wait_for(waiting, 30)
            assert lease.owner == "waiter"
            assert lease.fencing_token > held.fencing_token
    finally:
        server.stop()
