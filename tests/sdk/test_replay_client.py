"""The SDK's replay methods against a real server with authentication on: the state at an instant before
and after an acquire, the changes between two instants, an agent's history, a resource's history in a
time range, and the export, streamed, resumed after a cut connection and refused to the wrong roles."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta, timezone

import asyncpg
import httpx
import pytest

from domain.access import Role
from lockledger import AsyncClient, Client, Forbidden, Unauthorized, Unavailable, ValidationError
from lockledger.client import ExportedEvent, LeaseInfo, ReplayState
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage


async def db_now(admin_pool: asyncpg.Pool) -> datetime:
    """The database clock, which stamps every event."""
    value: datetime = await admin_pool.fetchval("SELECT clock_timestamp()")
    return value


@pytest.fixture
async def investigator(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> AsyncIterator[AsyncClient]:
    token = await issue_token(f"{unique_prefix}investigator", Role.INVESTIGATOR)
    async with AsyncClient(auth_server.base_url, token=token) as client:
        yield client


async def agent(auth_server: ServerProcess, issue_token: IssueToken, name: str) -> AsyncClient:
    return AsyncClient(auth_server.base_url, token=await issue_token(name, Role.AGENT))


def _leases(state: ReplayState) -> dict[str, tuple[str, int]]:
    return {lease.resource: (lease.owner, lease.fencing_token) for lease in state.locks}


async def test_a_lease_is_in_the_state_after_its_acquire_and_not_before(
    auth_server: ServerProcess,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    investigator: AsyncClient,
    unique_prefix: str,
) -> None:
    owner = f"{unique_prefix}agv-1"
    before = await db_now(admin_pool)
    async with await agent(auth_server, issue_token, owner) as client:
        lease = await client.acquire(f"{unique_prefix}zone", ttl=30)
    after = await db_now(admin_pool)

    state = await investigator.replay_state(after, prefix=unique_prefix)
    assert _leases(state) == {lease.resource: (owner, lease.fencing_token)}
    (live,) = state.locks
    assert live.acquired_at is not None
    assert before < live.acquired_at <= after
    assert live.expires_at == lease.expires_at
    assert state.at == after
    assert state.at.tzinfo is not None

    earlier = await investigator.replay_state(before, prefix=unique_prefix)
    assert earlier.locks == []
    assert 0 <= earlier.position < state.position

    # The same instant as RFC 3339 text in another zone, and through the blocking client: the same answer.
    text = after.astimezone(timezone(timedelta(hours=2))).isoformat()
    assert (await investigator.replay_state(text, prefix=unique_prefix)).locks == state.locks
    token = await issue_token(f"{unique_prefix}inv2", Role.INVESTIGATOR)
    with Client(auth_server.base_url, token=token) as blocking:
        assert blocking.replay_state(after, owner=owner).locks == state.locks


async def test_the_state_follows_every_page(
    auth_server: ServerProcess,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    investigator: AsyncClient,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lockledger import wire

    monkeypatch.setattr(wire, "STATE_PAGE", 2)  # five leases: three pages
    async with await agent(auth_server, issue_token, f"{unique_prefix}agv-2") as client:
        leases = [await client.acquire(f"{unique_prefix}zone-{i}", ttl=30) for i in range(5)]
    state = await investigator.replay_state(await db_now(admin_pool), prefix=unique_prefix)
    assert [lease.resource for lease in state.locks] == sorted(lease.resource for lease in leases)


async def test_the_changes_between_two_instants(
    auth_server: ServerProcess,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    investigator: AsyncClient,
    unique_prefix: str,
) -> None:
    start = await db_now(admin_pool)
    async with await agent(auth_server, issue_token, f"{unique_prefix}agv-3") as client:
        lease = await client.acquire(f"{unique_prefix}dock", ttl=30)
        await client.renew(lease.resource, None, lease.fencing_token, ttl=20)
        await client.release(lease.resource, None, lease.fencing_token)
    end = await db_now(admin_pool)

    found = await investigator.changes(start, end, prefix=unique_prefix)
    assert (found.from_, found.to) == (start, end)
    assert [c.type for c in found.changes] == ["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"]
    positions = [c.position for c in found.changes if c.position is not None]
    assert len(positions) == 3
    assert positions == sorted(positions)
    assert {(c.resource, c.fencing_token, c.version) for c in found.changes} == {
        (lease.resource, lease.fencing_token, v) for v in (1, 2, 3)
    }
    assert (await investigator.changes(end, end, prefix=unique_prefix)).changes == []


async def test_an_agents_history_across_resources(
    auth_server: ServerProcess,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    investigator: AsyncClient,
    unique_prefix: str,
) -> None:
    owner, other = f"{unique_prefix}agv-4", f"{unique_prefix}agv-5"
    async with await agent(auth_server, issue_token, owner) as client:
        first = await client.acquire(f"{unique_prefix}a", ttl=30)
        middle = await db_now(admin_pool)
        second = await client.acquire(f"{unique_prefix}b", ttl=30)
        await client.release(first.resource, None, first.fencing_token)
    async with await agent(auth_server, issue_token, other) as client:
        await client.acquire(f"{unique_prefix}c", ttl=30)

    history = await investigator.agent_history(owner)
    assert history.owner == owner
    assert [(e.resource, e.type) for e in history.events] == [
        (first.resource, "LOCK_ACQUIRED"), (second.resource, "LOCK_ACQUIRED"),
        (first.resource, "LOCK_RELEASED"),
    ]  # fmt: skip
    assert [e.position for e in history.events] == sorted(e.position for e in history.events)
    assert all(e.data["owner"] == owner and e.recorded_at.tzinfo is not None for e in history.events)

    later = await investigator.agent_history(owner, from_=middle)
    assert [(e.resource, e.type) for e in later.events] == [
        (second.resource, "LOCK_ACQUIRED"), (first.resource, "LOCK_RELEASED"),
    ]  # fmt: skip
    earlier = await investigator.agent_history(owner, to=middle.isoformat())
    assert [e.resource for e in earlier.events] == [first.resource]

    page = await investigator.agent_history(owner, limit=2)
    assert page.next_after_position == page.events[-1].position
    rest = await investigator.agent_history(owner, after_position=page.next_after_position, limit=2)
    assert [e.position for e in page.events + rest.events] == [e.position for e in history.events]


async def test_a_resources_history_in_a_time_range(
    auth_server: ServerProcess,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    investigator: AsyncClient,
    unique_prefix: str,
) -> None:
    async with await agent(auth_server, issue_token, f"{unique_prefix}agv-6") as client:
        lease = await client.acquire(f"{unique_prefix}bay", ttl=30)
        middle = await db_now(admin_pool)
        await client.release(lease.resource, None, lease.fencing_token)
    every = await investigator.history(lease.resource)
    assert [e.type for e in every.events] == ["LOCK_ACQUIRED", "LOCK_RELEASED"]
    assert [e.type for e in (await investigator.history(lease.resource, from_=middle)).events] == [
        "LOCK_RELEASED"
    ]
    assert [e.type for e in (await investigator.history(lease.resource, to=middle)).events] == [
        "LOCK_ACQUIRED"
    ]


# --- export --------------------------------------------------------------------------------------------


async def _some_events(auth_server: ServerProcess, issue_token: IssueToken, prefix: str) -> list[LeaseInfo]:
    """Nine events on three resources."""
    async with await agent(auth_server, issue_token, f"{prefix}agv-7") as client:
        leases = [await client.acquire(f"{prefix}r{i}", ttl=30) for i in range(3)]
        for lease in leases:
            await client.renew(lease.resource, None, lease.fencing_token)
            await client.release(lease.resource, None, lease.fencing_token)
    return leases


def _check_export(events: list[ExportedEvent], prefix: str) -> None:
    positions = [e.position for e in events]
    assert positions == sorted(set(positions))  # increasing, none twice
    assert len(events) == 9
    assert all(e.stream.startswith(prefix) for e in events)
    assert sorted(e.type for e in events) == sorted(["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"] * 3)
    for event in events:
        assert re.fullmatch(r"[0-9a-f]{64}", event.hash or "")
        assert json.loads(event.line or "null")["position"] == event.position
        assert event.recorded_at.tzinfo is not None


async def test_export_yields_every_event_in_order_and_resumes_after_a_position(
    auth_server: ServerProcess, issue_token: IssueToken, investigator: AsyncClient, unique_prefix: str
) -> None:
    await _some_events(auth_server, issue_token, unique_prefix)
    events = [e async for e in investigator.export(prefix=unique_prefix)]
    _check_export(events, unique_prefix)

    resumed = [e async for e in investigator.export(prefix=unique_prefix, after_position=events[3].position)]
    assert resumed == events[4:]
    acquired = [e async for e in investigator.export(prefix=unique_prefix, type="LOCK_ACQUIRED")]
    assert acquired == [e for e in events if e.type == "LOCK_ACQUIRED"]
    window = [e async for e in investigator.export(prefix=unique_prefix, from_=events[2].recorded_at,
                                                   to=events[5].recorded_at)]  # fmt: skip
    assert window == events[2:5]


def _cut(data: bytes, lines: int) -> int:
    """The offset in the middle of line ``lines + 1``: the whole lines before it go through."""
    offset = -1
    for _ in range(lines):
        offset = data.index(b"\n", offset + 1)
    return offset + 6


class Cutting(httpx.AsyncBaseTransport):
    """Forwards to a real transport; the export's first responses break off, as a dropped connection
    does, after ``lines[i]`` whole lines (and half of the next) for the i-th."""

    def __init__(self, *lines: int) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.lines = lines
        self.exports: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/events":
            return response
        self.exports.append(request)
        if len(self.exports) > len(self.lines):
            return response
        body = await response.aread()
        cut = _cut(body, self.lines[len(self.exports) - 1])

        async def broken() -> AsyncIterator[bytes]:
            yield body[:cut]
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

        return httpx.Response(response.status_code, headers=response.headers, content=broken())

    async def aclose(self) -> None:
        await self.inner.aclose()


class SyncCutting(httpx.BaseTransport):
    def __init__(self, *, lines: int) -> None:
        self.inner = httpx.HTTPTransport()
        self.lines = lines
        self.exports: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path != "/v1/events":
            return response
        self.exports.append(request)
        if len(self.exports) > 1:
            return response
        body = response.read()
        cut = _cut(body, self.lines)

        def broken() -> Iterator[bytes]:
            yield body[:cut]
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

        return httpx.Response(response.status_code, headers=response.headers, content=broken())

    def close(self) -> None:
        self.inner.close()


def _after_positions(requests: list[httpx.Request]) -> list[int]:
    return [int(r.url.params["after_position"]) for r in requests]


async def test_export_resumes_by_itself_after_a_cut_connection(
    auth_server: ServerProcess, issue_token: IssueToken, investigator: AsyncClient, unique_prefix: str
) -> None:
    await _some_events(auth_server, issue_token, unique_prefix)
    whole = [e async for e in investigator.export(prefix=unique_prefix)]
    token = await issue_token(f"{unique_prefix}inv-cut", Role.INVESTIGATOR)

    transport = Cutting(4)
    async with AsyncClient(auth_server.base_url, token=token, transport=transport) as client:
        events = [e async for e in client.export(prefix=unique_prefix)]
    assert events == whole  # each event once, in order, across the cut
    assert _after_positions(transport.exports) == [0, whole[3].position]

    sync_transport = SyncCutting(lines=2)
    with Client(auth_server.base_url, token=token, transport=sync_transport) as sync_client:
        assert list(sync_client.export(prefix=unique_prefix)) == whole
    assert _after_positions(sync_transport.exports) == [0, whole[1].position]


async def test_export_gives_up_after_bounded_cuts_without_progress(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    await _some_events(auth_server, issue_token, unique_prefix)
    token = await issue_token(f"{unique_prefix}inv-cuts", Role.INVESTIGATOR)
    transport = Cutting(2, 1, 0, 0, 0, 0)  # progress twice, then every connection breaks before an event
    received: list[ExportedEvent] = []

    async def read(client: AsyncClient) -> None:
        async for event in client.export(prefix=unique_prefix):
            received.append(event)

    async with AsyncClient(auth_server.base_url, token=token, transport=transport, retry_attempts=3) as c:
        with pytest.raises(Unavailable) as cut_off:
            await read(c)
    assert len(received) == 3
    positions = [e.position for e in received]
    assert _after_positions(transport.exports) == [0, positions[1], *[positions[2]] * 3]
    assert cut_off.value.status == 0
    assert f"after_position={positions[2]}" in cut_off.value.detail


# --- who may ask, and what ------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [Role.DASHBOARD, Role.AGENT])
async def test_a_dashboard_or_agent_token_is_refused_the_history(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str, role: Role
) -> None:
    token = await issue_token(f"{unique_prefix}{role.value}", role)
    now = datetime.now(UTC) - timedelta(seconds=1)
    async with AsyncClient(auth_server.base_url, token=token) as client:
        if role is Role.DASHBOARD:  # the dashboard's time slider reads the fleet at an instant, not history
            await client.replay_state(now, prefix=unique_prefix)
            await client.changes(now - timedelta(minutes=1), now, prefix=unique_prefix)
        else:
            with pytest.raises(Forbidden) as refused:
                await client.replay_state(now)
            assert refused.value.status == 403
            with pytest.raises(Forbidden):
                await client.changes(now - timedelta(minutes=1), now)
        with pytest.raises(Forbidden) as refused:
            await client.agent_history(f"{unique_prefix}agv")
        assert refused.value.status == 403
        with pytest.raises(Forbidden):
            [e async for e in client.export(prefix=unique_prefix)]
        assert client.breaker.metrics.failures == 0  # a 403 is a healthy server's answer
    async with AsyncClient(auth_server.base_url) as anonymous:
        with pytest.raises(Unauthorized):
            await anonymous.replay_state(now)


async def test_instants_the_sdk_or_the_server_refuses(investigator: AsyncClient) -> None:
    with pytest.raises(ValidationError) as future:
        await investigator.replay_state(datetime.now(UTC) + timedelta(hours=1))
    assert future.value.status == 422
    for naive in (datetime(2026, 1, 1), "2026-01-01T00:00:00", "yesterday"):
        with pytest.raises(ValueError, match=r"offset|naive") as refused:
            await investigator.replay_state(naive)
        assert isinstance(refused.value, ValidationError)
        assert refused.value.status == 0  # nothing was sent
    # What the server refuses with 422 is refused before sending: outside UTC's years, below microseconds.
    for refused_instant in ("0001-01-01T00:00:00+14:00", "2026-01-01T00:00:00.1234567Z"):
        with pytest.raises(ValidationError, match=r"outside years|fractional digits") as refused:
            await investigator.replay_state(refused_instant)
        assert refused.value.status == 0
    with pytest.raises(ValidationError, match="outside years") as refused:
        await investigator.changes(datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1))), datetime.now(UTC))
    assert refused.value.status == 0
    with pytest.raises(ValidationError):
        await investigator.agent_history("a/b")
