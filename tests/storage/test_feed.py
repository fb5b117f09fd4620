"""The change feed (GET /v1/events/stream) against real server processes on the test database.

Exactly once and in the documented order (docs/semantics.md, "The change feed"): windows of transaction ids
in order, position order within a window; a late commit (a lower position than events already delivered)
still arrives, once; a resume with Last-Event-ID loses and repeats nothing; a client that reads nothing
is told ``overflow`` and cut off; idle subscribers cost little; roles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import psutil
import pytest

from domain.access import Role
from domain.commands import Acquire
from eventstore.tail import Tail, Window
from lockledger.feed import SseMessage, parse_sse
from service.lock_service import CommandContext, LockService
from tests.servers import IssueToken, ServerProcess, running_server

pytestmark = [pytest.mark.storage, pytest.mark.slow]

WAIT_S = 60.0  # bound on every wait for events: generous for a shared 2-core machine


@pytest.fixture(scope="module")
def two_servers(database_url: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    overrides = {"LOCKLEDGER_REAPER_ENABLED": "false", "LOCKLEDGER_FEED_KEEPALIVE_S": "1"}
    with running_server(database_url, overrides) as one, running_server(database_url, overrides) as two:
        yield one, two


@dataclass
class Subscriber:
    """One SSE connection read in the background into ``messages``."""

    messages: list[SseMessage]
    task: asyncio.Task[None]
    arrived: asyncio.Event

    async def wait_for(self, count: int, what: str) -> None:
        try:
            async with asyncio.timeout(WAIT_S):
                while len(self.events()) < count:
                    self.arrived.clear()
                    await self.arrived.wait()
        except TimeoutError:
            raise AssertionError(
                f"{what}: {len(self.events())} of {count} events within {WAIT_S} s"
            ) from None

    def events(self) -> list[SseMessage]:
        return [m for m in self.messages if m.event != "overflow"]

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@contextlib.asynccontextmanager
async def subscribe(
    base_url: str, params: dict[str, Any], headers: dict[str, str] | None = None
) -> AsyncIterator[Subscriber]:
    messages: list[SseMessage] = []
    arrived = asyncio.Event()
    opened = asyncio.Event()

    async def read() -> None:
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(30.0, read=None)) as http,
            http.stream("GET", "/v1/events/stream", params=params, headers=headers or {}) as response,
        ):
            assert response.status_code == 200, response.status_code
            opened.set()
            async for message in parse_sse(response.aiter_lines()):
                messages.append(message)
                arrived.set()

    task = asyncio.create_task(read())
    async with asyncio.timeout(30):
        await asyncio.wait([task, asyncio.create_task(opened.wait())], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # the reason it ended
    subscriber = Subscriber(messages, task, arrived)
    try:
        yield subscriber
    finally:
        await subscriber.close()


async def _cycles(urls: list[str], prefix: str, first: int, count: int) -> None:
    """``count`` acquire+release pairs (two events each) on distinct resources, spread over ``urls``."""
    gate = asyncio.Semaphore(8)
    clients = [httpx.AsyncClient(base_url=url, timeout=30) for url in urls]

    async def cycle(i: int) -> None:
        http, resource = clients[i % len(clients)], f"{prefix}r{i}"
        async with gate:
            got = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot", "ttl_ms": 60_000})
            assert got.status_code == 201, got.text
            token = got.json()["fencing_token"]
            done = await http.post(
                f"/v1/locks/{resource}/release", json={"owner": "bot", "fencing_token": token}
            )
            assert done.status_code == 200, done.text

    try:
        await asyncio.gather(*(cycle(i) for i in range(first, first + count)))
    finally:
        for client in clients:
            await client.aclose()


async def _acquire(base_url: str, resource: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        got = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "late", "ttl_ms": 600_000})
        assert got.status_code == 201, got.text


async def _release_as_the_service(conn: asyncpg.Connection | Any, resource: str) -> int:
    """Append ``resource``'s release as the service would (event and lock_state), in ``conn``'s open
    transaction; its position."""
    acquired = await conn.fetchval(
        "SELECT data::text FROM events WHERE stream_id = $1 AND stream_version = 1", resource
    )
    data = {key: json.loads(acquired)[key] for key in ("owner", "fencing_token", "expires_at")}
    position: int = await conn.fetchval(
        "INSERT INTO events (stream_id, stream_version, event_type, data, metadata)"
        " VALUES ($1, 2, 'LOCK_RELEASED', $2::jsonb, '{\"command\": \"release\"}') RETURNING position",
        resource,
        json.dumps(data),
    )
    await conn.execute(  # updated_at is the event's instant, as the commit statement writes it
        "UPDATE lock_state SET version = version + 1, status = 'free', ended_by = 'LOCK_RELEASED',"
        " updated_at = (SELECT recorded_at FROM events WHERE position = $2) WHERE resource = $1",
        resource,
        position,
    )
    return position


async def _log(admin_pool: asyncpg.Pool, prefix: str) -> dict[int, int]:
    """position -> tx_id of every event under ``prefix``."""
    async with admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT position, tx_id::text::bigint AS tx FROM events WHERE starts_with(stream_id, $1)", prefix
        )
    return {row["position"]: row["tx"] for row in rows}


def _check_order(messages: list[SseMessage], log: dict[int, int]) -> None:
    """The documented order: windows ``[lo, hi)`` contiguous and ascending, each event's transaction in
    its window, positions ascending within a window."""
    previous: tuple[int, int, int] | None = None
    for message in messages:
        assert message.id is not None
        position, lo, hi = (int(part) for part in message.id.split("."))
        assert json.loads(message.data)["position"] == position
        assert lo <= log[position] < hi, f"event {position} (tx {log[position]}) outside its window {lo}-{hi}"
        if previous is not None:
            p_position, p_lo, p_hi = previous
            if (lo, hi) == (p_lo, p_hi):
                assert position > p_position, f"{position} after {p_position} within one window"
            else:
                assert lo >= p_hi, f"window {lo}-{hi} after {p_lo}-{p_hi}"
        previous = (position, lo, hi)


async def test_two_writers_exactly_once_in_order_with_a_late_commit(
    two_servers: tuple[ServerProcess, ServerProcess], admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    one, two = two_servers
    urls = [one.base_url, two.base_url]
    late = f"{unique_prefix}late"
    async with subscribe(one.base_url, {"prefix": unique_prefix}) as subscriber:
        await _acquire(two.base_url, late)
        async with admin_pool.acquire() as conn, conn.transaction():
            late_position = await _release_as_the_service(conn, late)
            await _cycles(urls, unique_prefix, 0, 250)  # 500 events, committed while the release is not
            visible = await _log(admin_pool, unique_prefix)
            assert max(visible) > late_position
            assert late_position not in visible
        await _cycles(urls, unique_prefix, 250, 249)  # 498 more: 1,000 with the acquire and the release
        await subscriber.wait_for(1_000, "1,000 events")
        await asyncio.sleep(0.5)  # time for a duplicate to show up, if there were one
        received = subscriber.events()
    log = await _log(admin_pool, unique_prefix)
    positions = [json.loads(m.data)["position"] for m in received]
    assert len(log) == 1_000
    assert sorted(positions) == sorted(log), "not every event exactly once"
    assert positions.count(late_position) == 1
    _check_order(received, log)


async def test_resume_with_last_event_id_keeps_a_late_commit_below_it(
    two_servers: tuple[ServerProcess, ServerProcess], admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    """An event committed late below the last position a client saw still reaches it after a resume on
    another server: the id carries the transaction boundary, not the position alone."""
    one, two = two_servers
    urls = [one.base_url, two.base_url]
    x, y = f"{unique_prefix}x", f"{unique_prefix}y"
    async with subscribe(one.base_url, {"prefix": unique_prefix}) as first:
        await _cycles(urls, unique_prefix, 0, 50)
        await _acquire(one.base_url, x)
        await _acquire(one.base_url, y)
        await first.wait_for(102, "first connection")
        async with admin_pool.acquire() as conn_x, admin_pool.acquire() as conn_y:
            tx_y = conn_y.transaction()
            await tx_y.start()
            await conn_y.execute("SELECT pg_current_xact_id()")  # Y's id is older than X's
            async with conn_x.transaction():
                x_position = await _release_as_the_service(conn_x, x)
                y_position = await _release_as_the_service(conn_y, y)
                await tx_y.commit()  # below every running transaction: delivered, above X's position
                await first.wait_for(103, "Y's release")
                seen = list(first.events())
                assert json.loads(seen[-1].data)["position"] == y_position > x_position
                await first.close()
                await _cycles(urls, unique_prefix, 50, 50)  # while nobody is connected
    last = seen[-1].id
    assert last is not None
    async with subscribe(two.base_url, {"prefix": unique_prefix}, {"Last-Event-ID": last}) as second:
        await _cycles(urls, unique_prefix, 100, 25)
        try:
            await second.wait_for(151, "after the resume")  # X's release, 100 + 50 events
        except AssertionError as failed:
            log = await _log(admin_pool, unique_prefix)
            got = {json.loads(m.data)["position"] for m in seen + second.events()}
            missing = {p: log[p] for p in log if p not in got}
            raise AssertionError(f"{failed}; resumed from {last}, missing (position: tx) {missing}") from None
        await asyncio.sleep(0.5)
        resumed = second.events()
    log = await _log(admin_pool, unique_prefix)
    positions = [json.loads(m.data)["position"] for m in seen + resumed]
    assert sorted(positions) == sorted(log), "the resume lost or repeated events"
    assert x_position in [json.loads(m.data)["position"] for m in resumed]


async def test_the_position_floor_never_hides_a_running_transaction(
    admin_pool: asyncpg.Pool, lock_service: LockService, unique_prefix: str
) -> None:
    """X draws its position and keeps running; Y, whose id is older, commits a higher position after it,
    and so do later transactions. The windows read once X commits contain X's event, once, whatever
    floor the reader's history gives (a snapshot's xmax would have claimed X's id was not yet taken)."""
    tail = Tail()
    windows: list[Window] = []

    async def poll(reader: asyncpg.Connection | Any) -> None:
        window = await tail.poll(reader)
        if window is not None:
            tail.advance(window)
            windows.append(window)

    x, y = f"{unique_prefix}x", f"{unique_prefix}y"
    for resource in (x, y):
        await lock_service.execute(Acquire(resource, "bot", 600_000), CommandContext())
    async with admin_pool.acquire() as reader, admin_pool.acquire() as conn_x, admin_pool.acquire() as conn_y:
        await tail.start(reader)
        tx_y = conn_y.transaction()
        await tx_y.start()
        await conn_y.execute("SELECT pg_current_xact_id()")
        async with conn_x.transaction():
            x_position = await _release_as_the_service(conn_x, x)
            y_position = await _release_as_the_service(conn_y, y)
            await tx_y.commit()
            await poll(reader)  # Y's position is the largest visible, X is the latest id running
            await poll(reader)
            for i in range(5):  # the reader's history grows while X runs, with later positions visible
                await poll(reader)
                await lock_service.execute(Acquire(f"{unique_prefix}r{i}", "bot", 60_000), CommandContext())

        def seen() -> list[int]:
            return [e.position for w in windows for e in w.events if e.stream.startswith(unique_prefix)]

        # The xmin is the whole server's: a transaction of another database can hold the later windows back.
        for _ in range(200):
            await poll(reader)
            if len(seen()) >= 7:
                break
            await asyncio.sleep(0.05)
    mine = seen()
    assert mine.count(x_position) == 1, f"X's release ({x_position}) in {mine}"
    assert len(mine) == len(set(mine)) == 7
    assert y_position > x_position


def _rss(server: ServerProcess) -> int:
    assert server.process is not None
    return int(psutil.Process(server.process.pid).memory_info().rss)


def _raw_subscription(server: ServerProcess, params: str) -> socket.socket:
    """An SSE request on a socket with a tiny receive buffer that is then never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(
        f"GET /v1/events/stream?{params} HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    return sock


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(WAIT_S)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def test_a_client_that_reads_nothing_is_told_overflow_and_cut_off(
    database_url: str, unique_prefix: str
) -> None:
    overrides = {"LOCKLEDGER_REAPER_ENABLED": "false", "LOCKLEDGER_FEED_QUEUE_SIZE": "20"}
    with running_server(database_url, overrides) as server:
        await _cycles([server.base_url], f"{unique_prefix}warm", 0, 20)
        before = _rss(server)
        sock = _raw_subscription(server, f"prefix={unique_prefix}")
        try:
            await asyncio.sleep(0.5)
            await _cycles([server.base_url], unique_prefix, 0, 1_000)  # 2,000 events
            grown = _rss(server) - before
            body = await asyncio.to_thread(_read_all, sock)  # ends: the server closed the stream
        finally:
            sock.close()
    text = body.decode()
    assert "event: overflow" in text, text[-500:]
    tail = text[text.index("event: overflow") :]
    resume = json.loads(tail.split("data: ", 1)[1].split("\n", 1)[0])["last_event_id"]
    assert resume.count(".") == 2
    assert text.count("event: LOCK_") < 2_000, "the whole backlog was buffered for a client reading nothing"
    assert grown < 30 * 2**20, f"server grew {grown} bytes for one stalled client"


async def test_idle_subscribers_cost_bounded_memory(database_url: str, unique_prefix: str) -> None:
    overrides = {"LOCKLEDGER_REAPER_ENABLED": "false"}
    with running_server(database_url, overrides) as server:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
        timeout = httpx.Timeout(30.0, read=None)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=timeout) as http:
            params = {"prefix": unique_prefix}
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(10):  # warm up the code paths
                    await stack.enter_async_context(http.stream("GET", "/v1/events/stream", params=params))
                await asyncio.sleep(0.5)
                before = _rss(server)
                opened = [http.stream("GET", "/v1/events/stream", params=params) for _ in range(200)]
                responses = await asyncio.gather(*(stack.enter_async_context(s) for s in opened))
                assert all(response.status_code == 200 for response in responses)
                await asyncio.sleep(1.0)
                per_subscriber = (_rss(server) - before) / 200
        assert per_subscriber < 200 * 1024, f"{per_subscriber:.0f} bytes per idle subscriber"


async def test_roles(auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str) -> None:
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30) as http:
        assert (await http.get("/v1/events/stream")).status_code == 401
        for role, allowed in [
            (Role.AGENT, False), (Role.DASHBOARD, True), (Role.INVESTIGATOR, True), (Role.ADMIN, True),
        ]:  # fmt: skip
            token = await issue_token(f"{unique_prefix}{role}", role)
            headers = {"Authorization": f"Bearer {token}"}
            async with http.stream("GET", "/v1/events/stream", headers=headers) as response:
                assert response.status_code == (200 if allowed else 403), role
                if allowed:
                    assert response.headers["content-type"].startswith("text/event-stream")
        token = await issue_token(f"{unique_prefix}bad", Role.ADMIN)
        bad = await http.get(
            "/v1/events/stream", headers={"Authorization": f"Bearer {token}", "Last-Event-ID": "1.x"}
        )
        assert bad.status_code == 422
