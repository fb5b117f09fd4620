"""Managed leases against the real server: background renewals, waiting, loss detection, release."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from lockledger import AsyncClient, BreakerConfig, CircuitBreaker, Client, LockHeld, LockLost
from lockledger.client import LeaseInfo
from lockledger.errors import Unavailable
from tests.servers import ServerProcess, free_port, running_server

pytestmark = pytest.mark.storage


def local_deadline_on_the_wall_clock(deadline: float) -> datetime:
    """A lease's local (monotonic) deadline as a wall-clock instant, comparable with the server's.

    The wall clock is read first: a preemption between the two reads can only move the result earlier.
    """
    wall, monotonic = datetime.now(UTC), time.monotonic()
    return wall + timedelta(seconds=deadline - monotonic)


class Cuttable(httpx.AsyncBaseTransport):
    """A real transport with a switch: once ``cut``, every request fails as if the network were gone."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.cut = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.cut:
            raise httpx.ConnectError("network cut", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Counting(Cuttable):
    """Counts the requests that reach the network."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return await super().handle_async_request(request)


class SyncCuttable(httpx.BaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.cut = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.cut:
            raise httpx.ConnectError("network cut", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


async def test_lease_is_kept_alive_by_renewals_and_released(server: ServerProcess, resource: str) -> None:
    async with AsyncClient(server.base_url) as client:
        async with client.lock(resource, ttl=1.5) as lease:
            assert lease.resource == resource
            assert lease.owner == client.agent_id
            assert lease.fencing_token >= 1
            first_expiry = lease.expires_at
            await asyncio.sleep(5.0)  # more than 3 x ttl
            lease.check()
            assert not lease.lost.is_set()
            assert lease.renewals >= 6
            assert lease.expires_at is not None
            assert first_expiry is not None
            assert lease.expires_at > first_expiry
            assert (await client.get_lock(resource)).owner == client.agent_id
        assert lease.lost.is_set()  # over: no longer to be trusted
        types = [e.type for e in (await client.history(resource)).events]
        assert (await client.get_lock(resource)).status == "free"
    assert types[0] == "LOCK_ACQUIRED"
    assert types[-1] == "LOCK_RELEASED"
    assert types.count("LOCK_RENEWED") >= 6
    assert "LOCK_EXPIRED" not in types


async def _release_after(client: AsyncClient, held: LeaseInfo, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await client.release(held.resource, held.owner, held.fencing_token)


async def test_wait_acquires_when_the_holder_releases_in_time(server: ServerProcess, resource: str) -> None:
    async with AsyncClient(server.base_url) as client:
        held = await client.acquire(resource, "other", ttl=10)
        releaser = asyncio.create_task(_release_after(client, held, 0.5))
        started = time.monotonic()
        async with client.lock(resource, owner="me", ttl=5, wait=3) as lease:
            assert time.monotonic() - started >= 0.5
            assert lease.fencing_token > held.fencing_token
            assert lease.owner == "me"
        await releaser


async def test_a_lease_granted_late_in_its_wait_counts_its_deadline_from_a_renewal(
    server: ServerProcess, resource: str
) -> None:
    """The local deadline counts from when the request left; after 1.5 s waiting on the server for a
    3 s lease, that would leave 1.2 s. The lease renews at once and counts from the renewal instead."""
    async with AsyncClient(server.base_url) as client:
        held = await client.acquire(resource, "other", ttl=10)
        started = time.monotonic()
        releaser = asyncio.create_task(_release_after(client, held, 1.5))
        async with client.lock(resource, owner="me", ttl=3, wait=5) as lease:
            # Counted from the acquire request, the deadline would fall before started + 1.5 s.
            assert lease.deadline >= started + 1.5 + 3 * (1 - lease.safety_margin)
            assert not lease.lost.is_set()
            events = (await client.history(resource)).events
            assert [e.type for e in events][-2:] == ["LOCK_ACQUIRED", "LOCK_RENEWED"]
        await releaser


async def test_wait_gives_up_with_lock_held(server: ServerProcess, resource: str) -> None:
    async with AsyncClient(server.base_url) as client:
        await client.acquire(resource, "other", ttl=10)
        started = time.monotonic()
        with pytest.raises(LockHeld) as held:
            async with client.lock(resource, ttl=5, wait=0.6):
                pytest.fail("must not acquire")
        assert time.monotonic() - started >= 0.6
        assert held.value.holder == "other"
        with pytest.raises(LockHeld):  # wait=0: a single attempt
            async with client.lock(resource, ttl=5):
                pytest.fail("must not acquire")


async def test_lost_fires_before_the_server_deadline_when_renewals_fail(
    server: ServerProcess, resource: str
) -> None:
    transport = Cuttable()
    calls: list[LockLost] = []
    local_deadlines: list[datetime] = []

    def on_lost(error: LockLost) -> None:
        local_deadlines.append(local_deadline_on_the_wall_clock(lease.deadline))
        calls.append(error)

    breaker = CircuitBreaker(BreakerConfig(minimum_number_of_calls=2, sliding_window_size=4))
    client = AsyncClient(server.base_url, transport=transport, breaker=breaker, retry_timeout=1.0)
    async with client, client.lock(resource, ttl=1.5, on_lost=on_lost) as lease:
        await asyncio.sleep(0.8)  # at least one renewal went through
        assert lease.renewals >= 1
        transport.cut = True
        await asyncio.wait_for(lease.lost.wait(), timeout=10.0)
        server_deadline = lease.expires_at  # from the last renewal that got through
        assert server_deadline is not None
        # The watchdog gave up at its own deadline, which falls before the server's: when it woke on a
        # busy machine is the scheduler's business, what it waited for is the lease's.
        assert lease.lost_reason == "renewals failed until the local deadline passed"
        assert local_deadlines[0] < server_deadline
        with pytest.raises(LockLost):
            lease.check()
        transport.cut = False
    # exit released best effort (the breaker is still open): no error escapes a lost lease
    assert len(calls) == 1
    assert calls[0].resource == resource
    assert calls[0].fencing_token == lease.fencing_token


async def test_lost_fires_at_once_when_a_renewal_is_refused(server: ServerProcess, resource: str) -> None:
    async with AsyncClient(server.base_url) as client, client.lock(resource, ttl=3) as lease:
        await client.force_release(resource, "operator took the zone")
        await asyncio.wait_for(lease.lost.wait(), timeout=10.0)
        # Told by the next renewal's refusal, not by the local deadline running out.
        assert lease.lost_reason == "renewal refused: not_holder"
        # exit swallowed the NotHolder of the release


def test_sync_lease_renews_releases_and_detects_loss(server: ServerProcess, resource: str) -> None:
    transport = SyncCuttable()
    lost = threading.Event()
    with Client(server.base_url, transport=transport, retry_timeout=1.0) as client:
        with client.lock(resource, ttl=1.2, on_lost=lambda _: lost.set()) as lease:
            time.sleep(1.5)
            lease.check()
            assert lease.renewals >= 2
            assert client.get_lock(resource).owner == client.agent_id
        assert client.get_lock(resource).status == "free"

        with client.lock(resource, ttl=1.2, on_lost=lambda _: lost.set()) as lease:
            transport.cut = True
            assert lease.lost.wait(10.0)
            server_deadline = lease.expires_at
            assert server_deadline is not None
            assert lease.lost_reason == "renewals failed until the local deadline passed"
            assert local_deadline_on_the_wall_clock(lease.deadline) < server_deadline
            assert lost.is_set()
            with pytest.raises(LockLost):
                lease.check()
            transport.cut = False


def test_sync_lease_waits_on_the_server_across_its_maximum(server: ServerProcess, resource: str) -> None:
    """The test server waits at most 2 s per request; a 6 s ``wait`` asks again for what is left, and is
    granted when the holder releases 3 s in, with a deadline counted from after the grant."""
    with Client(server.base_url) as client:
        held = client.acquire(resource, "other", ttl=10)
        releaser = threading.Timer(3.0, client.release, (resource, "other", held.fencing_token))
        releaser.start()
        started = time.monotonic()
        try:
            with client.lock(resource, owner="me", ttl=3, wait=6) as lease:
                assert time.monotonic() - started >= 3.0
                assert lease.fencing_token > held.fencing_token
                assert lease.deadline >= started + 3.0 + 3 * (1 - lease.safety_margin)
        finally:
            releaser.join()
        assert client.get_lock(resource).status == "free"


async def test_a_server_that_does_not_wait_is_not_polled_in_a_spin(database_url: str, resource: str) -> None:
    """With ``LOCKLEDGER_MAX_WAIT_MS=0`` every refusal comes back at once; the lease backs off between
    asking (full jitter, up to 1 s) instead of asking again at once for 1.5 s."""
    with running_server(database_url, {"LOCKLEDGER_MAX_WAIT_MS": "0"}) as server:
        transport = Counting()
        async with AsyncClient(server.base_url, transport=transport) as client:
            await client.acquire(resource, "other", ttl=10)
            transport.requests = 0
            started = time.monotonic()
            with pytest.raises(LockHeld):
                async with client.lock(resource, owner="me", ttl=5, wait=1.5):
                    pytest.fail("must not acquire")
            assert time.monotonic() - started >= 1.5
            assert 3 <= transport.requests <= 30


async def test_a_lease_with_nothing_listening_raises_unavailable(resource: str) -> None:
    async with AsyncClient(f"http://127.0.0.1:{free_port()}", retry_attempts=2) as client:
        with pytest.raises(Unavailable) as unavailable:
            async with client.lock(resource, ttl=5):
                pytest.fail("must not acquire")
    assert isinstance(unavailable.value.__cause__, httpx.ConnectError)


def test_a_sync_lease_with_nothing_listening_raises_unavailable(resource: str) -> None:
    client = Client(f"http://127.0.0.1:{free_port()}", retry_attempts=2)
    with client, pytest.raises(Unavailable) as unavailable, client.lock(resource, ttl=5):
        pytest.fail("must not acquire")
    assert isinstance(unavailable.value.__cause__, httpx.ConnectError)


def _renewals_failed_with(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        str(getattr(record, "error", ""))
        for record in caplog.records
        if record.name == "lockledger.lease" and record.getMessage() == "renewal failed, will retry"
    ]


def _never_opens() -> CircuitBreaker:
    """A breaker that gives no verdict in a short test: the transport's own errors reach the lease, not
    the breaker's fast refusals."""
    return CircuitBreaker(BreakerConfig(sliding_window_size=10_000, minimum_number_of_calls=10_000))


async def test_a_cut_network_surfaces_as_unavailable_in_heartbeats_and_release(
    server: ServerProcess, resource: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A heartbeat that cannot reach the server fails with the SDK's Unavailable (and is retried);
    a release on exit, while the lease is not yet lost, raises it to the caller."""
    caplog.set_level(logging.INFO, logger="lockledger.lease")
    transport = Cuttable()
    client = AsyncClient(
        server.base_url, transport=transport, retry_attempts=2, retry_timeout=0.5, breaker=_never_opens()
    )
    async with client:
        lease = await client.lock(resource, ttl=6).__aenter__()
        transport.cut = True
        give_up = time.monotonic() + 5
        while not _renewals_failed_with(caplog):
            assert time.monotonic() < give_up, "no renewal was tried"
            await asyncio.sleep(0.05)
        assert not lease.lost.is_set()
        with pytest.raises(Unavailable) as unavailable:
            await lease.__aexit__(None, None, None)
        assert isinstance(unavailable.value.__cause__, httpx.ConnectError)
        assert "/release" in unavailable.value.detail
    assert all(error.startswith("Unavailable(") for error in _renewals_failed_with(caplog))


def test_a_cut_network_surfaces_as_unavailable_in_sync_heartbeats_and_release(
    server: ServerProcess, resource: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lockledger.lease")
    transport = SyncCuttable()
    with Client(
        server.base_url, transport=transport, retry_attempts=2, retry_timeout=0.5, breaker=_never_opens()
    ) as client:
        lease = client.lock(resource, ttl=6).__enter__()
        transport.cut = True
        give_up = time.monotonic() + 5
        while not _renewals_failed_with(caplog):
            assert time.monotonic() < give_up, "no renewal was tried"
            time.sleep(0.05)
        assert not lease.lost.is_set()
        with pytest.raises(Unavailable) as unavailable:
            lease.__exit__(None, None, None)
        assert isinstance(unavailable.value.__cause__, httpx.ConnectError)
        assert "/release" in unavailable.value.detail
    assert all(error.startswith("Unavailable(") for error in _renewals_failed_with(caplog))
