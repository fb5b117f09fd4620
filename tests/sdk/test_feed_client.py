"""``AsyncClient.watch``: the change feed through the SDK against a real server with authentication on.

The SSE parser on its own; every event once and in order across a connection that breaks mid-message
and across the server's ``overflow`` (both resumed with Last-Event-ID by the SDK itself); the filters;
the roles.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from domain.access import Role
from lockledger import AsyncClient, Client, Forbidden
from lockledger.feed import FeedEvent, SseMessage, parse_sse
from tests.servers import IssueToken, ServerProcess

WAIT_S = 60.0


async def _lines(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def test_the_parser_reads_the_event_stream_format() -> None:
    lines = _lines(
        ": keep-alive", "", "id: 7.1.2", "event: LOCK_ACQUIRED", "data: {\"a\":", "data:1}", "",
        "data: no id", "", "event: cut", "data: never finished",
    )  # fmt: skip
    messages = [m async for m in parse_sse(lines)]
    assert messages == [
        SseMessage("LOCK_ACQUIRED", '{"a":\n1}', "7.1.2"),
        SseMessage("message", "no id", None),
    ]


class Interrupting(httpx.AsyncBaseTransport):
    """Forwards to a real transport; the feed's first response ends after ``after`` whole messages,
    either broken off mid-message (``cut``) or with the server's overflow message."""

    def __init__(self, after: int, how: str) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.after, self.how = after, how
        self.streams: list[httpx.Request] = []
        self.resume_id: str | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/events/stream" or response.status_code != 200:
            return response
        self.streams.append(request)
        if len(self.streams) > 1:
            return response

        async def interrupted() -> AsyncIterator[bytes]:
            buffer, sent = b"", 0
            try:
                async for chunk in response.aiter_raw():
                    buffer += chunk
                    while b"\n\n" in buffer or b"\r\n\r\n" in buffer:
                        message, _, buffer = buffer.replace(b"\r\n", b"\n").partition(b"\n\n")
                        if message.startswith(b":"):
                            continue
                        yield message + b"\n\n"
                        self.resume_id = next(
                            line[4:].decode() for line in message.split(b"\n") if line.startswith(b"id: ")
                        )
                        sent += 1
                        if sent == self.after:
                            if self.how == "overflow":
                                body = json.dumps({"detail": "too slow", "last_event_id": self.resume_id})
                                yield f"event: overflow\nid: {self.resume_id}\ndata: {body}\n\n".encode()
                                return
                            yield b'id: 999.1.2\nevent: LOCK_ACQUIRED\ndata: {"posi'
                            raise httpx.RemoteProtocolError("peer closed connection mid-message")
            finally:
                await response.aclose()

        return httpx.Response(200, headers=response.headers, content=interrupted())

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _cycles(client: AsyncClient, prefix: str, count: int) -> None:
    for i in range(count):
        lease = await client.acquire(f"{prefix}r{i}", ttl=60)
        await client.release(lease.resource, None, lease.fencing_token)


async def _collect(watch: AsyncIterator[FeedEvent], into: list[FeedEvent], count: int) -> None:
    async for event in watch:
        into.append(event)
        if len(into) == count:
            return


@pytest.mark.storage
@pytest.mark.parametrize("how", ["cut", "overflow"])
async def test_watch_resumes_by_itself_and_loses_and_repeats_nothing(
    auth_server: ServerProcess,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    unique_prefix: str,
    how: str,
) -> None:
    transport = Interrupting(5, how)
    dashboard = await issue_token(f"{unique_prefix}dash", Role.DASHBOARD)
    agent = await issue_token(f"{unique_prefix}agent", Role.AGENT)
    received: list[FeedEvent] = []
    async with (
        AsyncClient(auth_server.base_url, token=dashboard, transport=transport) as watcher,
        AsyncClient(auth_server.base_url, token=agent) as writer,
    ):
        task = asyncio.create_task(_collect(watcher.watch(prefix=unique_prefix), received, 20))
        for _ in range(100):  # the subscription is open once its request went out
            if transport.streams:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        await _cycles(writer, unique_prefix, 10)
        try:
            async with asyncio.timeout(WAIT_S):
                await task
        except TimeoutError:
            raise AssertionError(f"{len(received)} of 20 events within {WAIT_S} s") from None
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    async with admin_pool.acquire() as conn:
        log = await conn.fetch(
            "SELECT position FROM events WHERE starts_with(stream_id, $1) ORDER BY position", unique_prefix
        )
    assert sorted(e.position for e in received) == [r["position"] for r in log]
    assert len(transport.streams) == 2
    assert transport.streams[1].headers["Last-Event-ID"] == received[4].id == transport.resume_id
    assert [e.type for e in received].count("LOCK_ACQUIRED") == 10


@pytest.mark.storage
async def test_watch_filters_and_roles(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    investigator = await issue_token(f"{unique_prefix}inv", Role.INVESTIGATOR)
    agent = await issue_token(f"{unique_prefix}agent", Role.AGENT)
    async with (
        AsyncClient(auth_server.base_url, token=investigator) as watcher,
        AsyncClient(auth_server.base_url, token=agent) as writer,
    ):
        await _cycles(writer, unique_prefix, 3)
        first = [e async for e in _take(watcher.watch(0, prefix=unique_prefix, type="LOCK_RELEASED"), 3)]
        assert [e.type for e in first] == ["LOCK_RELEASED"] * 3
        assert [e.stream for e in first] == [f"{unique_prefix}r{i}" for i in range(3)]
        owner = f"{unique_prefix}agent"
        mine = [e async for e in _take(watcher.watch(0, prefix=unique_prefix, owner=owner), 6)]
        assert {e.data["owner"] for e in mine} == {owner}
        with pytest.raises(Forbidden):
            await anext(writer.watch())


async def _take(watch: AsyncIterator[FeedEvent], count: int) -> AsyncIterator[FeedEvent]:
    async with asyncio.timeout(WAIT_S):
        taken = 0
        async for event in watch:
            yield event
            taken += 1
            if taken == count:
                return


@pytest.mark.storage
async def test_the_blocking_client_watches_the_same_feed(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    """``Client.watch`` is generated from ``AsyncClient.watch``: the same events, the same records."""
    investigator = await issue_token(f"{unique_prefix}inv", Role.INVESTIGATOR)
    agent = await issue_token(f"{unique_prefix}agent", Role.AGENT)
    async with AsyncClient(auth_server.base_url, token=agent) as writer:
        await _cycles(writer, unique_prefix, 2)

    def first_four() -> list[FeedEvent]:
        with Client(auth_server.base_url, token=investigator) as watcher:
            return list(itertools.islice(watcher.watch(0, prefix=unique_prefix), 4))

    events = await asyncio.to_thread(first_four)
    assert [e.type for e in events] == ["LOCK_ACQUIRED", "LOCK_RELEASED"] * 2
    assert all(e.id is not None and e.hash is not None for e in events)
