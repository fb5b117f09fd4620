"""Two lean HTTP/1.1 clients for the load generator, keep-alive, POST only.

- ``aiohttp``: one ``ClientSession`` whose connector keeps at least W connections alive.
- ``httptools``: a minimal client on asyncio's transport/protocol layer (the level asyncio streams are
  built on, without their buffering), one connection per agent, responses parsed by
  ``httptools.HttpResponseParser`` (llhttp, the parser uvicorn uses).

Either way each agent has its own API token: ``open(tokens)`` gives agent i a connection handle that sends
``Authorization: Bearer <tokens[i]>`` on every request (its header bytes, or its header dict, built once).

The load generator shares two cores with the server and PostgreSQL, so every microsecond of client CPU
is taken from the system under test; the runner measures both and uses the leaner (see calibrate.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol, cast

import aiohttp
import httptools

from bench.auth import bearer

CLIENT_KINDS = ("httptools", "aiohttp")


class HttpConnection(Protocol):
    async def post(self, path: str, body: bytes, idempotency_key: str) -> tuple[int, bytes]:
        """Send one request; the status and body of its response."""


class HttpClient(Protocol):
    kind: str

    async def open(self, tokens: Sequence[str]) -> None:
        """One agent connection per token; connection ``i`` authenticates with ``tokens[i]``."""

    def connection(self, index: int) -> HttpConnection: ...

    async def close(self) -> None: ...


class _RawConnection(asyncio.Protocol):
    """One keep-alive connection; one request in flight at a time (an agent waits for each reply)."""

    def __init__(self, host: str, port: int, timeout_s: float, token: str) -> None:
        self._host = host
        self._port = port
        self._timeout_s = timeout_s
        # Every header but the key and the length, built once per connection.
        self._headers = (
            f"Host: {host}:{port}\r\nAuthorization: {bearer(token)}\r\n"
            "Content-Type: application/json\r\nIdempotency-Key: "
        ).encode()
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._body: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _connect(self) -> asyncio.Transport:
        self._loop = asyncio.get_running_loop()
        transport, _ = await self._loop.create_connection(lambda: self, self._host, self._port)
        return transport

    async def post(self, path: str, body: bytes, idempotency_key: str) -> tuple[int, bytes]:
        transport = self._transport
        if transport is None or transport.is_closing():
            transport = await self._connect()
        loop = self._loop
        assert loop is not None
        waiter: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        self._waiter = waiter
        self._body = []
        transport.write(
            b"".join(
                (
                    f"POST {path} HTTP/1.1\r\n".encode(),
                    self._headers,
                    idempotency_key.encode(),
                    f"\r\nContent-Length: {len(body)}\r\n\r\n".encode(),
                    body,
                )
            )
        )
        timer = loop.call_later(self._timeout_s, self._time_out, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()

    def _fail(self, error: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _time_out(self, waiter: asyncio.Future[tuple[int, bytes]]) -> None:
        if waiter is self._waiter:
            self._fail(TimeoutError(f"no response within {self._timeout_s} s"))
            if self._transport is not None:
                self._transport.close()  # a late response must not be taken for the next one's

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport
        self._parser = httptools.HttpResponseParser(self)

    def data_received(self, data: bytes) -> None:
        assert self._parser is not None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(error)
            if self._transport is not None:
                self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._fail(exc or ConnectionResetError("connection closed by the server"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter, self._waiter = self._waiter, None
        parser = self._parser
        assert parser is not None
        if waiter is not None and not waiter.done():
            waiter.set_result((parser.get_status_code(), b"".join(self._body)))
        if not parser.should_keep_alive() and self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class RawHttpClient:
    """httptools over asyncio transports: one connection per agent, opened on first use."""

    kind = "httptools"

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self._host, self._port, self._timeout_s = host, port, timeout_s
        self._connections: list[_RawConnection] = []

    async def open(self, tokens: Sequence[str]) -> None:
        self._connections = [_RawConnection(self._host, self._port, self._timeout_s, t) for t in tokens]

    def connection(self, index: int) -> HttpConnection:
        return self._connections[index]

    async def close(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections = []
        await asyncio.sleep(0)  # let the transports close


class _AiohttpAgent:
    """One agent's handle on the shared session: its own headers (its token), built once."""

    def __init__(self, session: aiohttp.ClientSession, base: str, token: str) -> None:
        self._session = session
        self._base = base
        self._headers = {"Content-Type": "application/json", "Authorization": bearer(token)}

    async def post(self, path: str, body: bytes, idempotency_key: str) -> tuple[int, bytes]:
        headers = {**self._headers, "Idempotency-Key": idempotency_key}
        async with self._session.post(self._base + path, data=body, headers=headers) as response:
            return response.status, await response.read()


class AiohttpClient:
    """One aiohttp session, a connector keeping up to one socket per agent alive (or ``max_connections``,
    for many agents that take turns)."""

    kind = "aiohttp"

    def __init__(self, host: str, port: int, timeout_s: float, max_connections: int | None = None) -> None:
        self._base = f"http://{host}:{port}"
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._agents: list[_AiohttpAgent] = []

    async def open(self, tokens: Sequence[str]) -> None:
        connections = self._max_connections or len(tokens)
        connector = aiohttp.TCPConnector(
            limit=connections, limit_per_host=connections, keepalive_timeout=60, ttl_dns_cache=None
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self._agents = [_AiohttpAgent(self._session, self._base, token) for token in tokens]

    def connection(self, index: int) -> HttpConnection:
        return self._agents[index]

    async def close(self) -> None:
        self._agents = []
        if self._session is not None:
            await self._session.close()
            self._session = None


def make_client(kind: str, host: str, port: int, timeout_s: float) -> HttpClient:
    if kind == "httptools":
        return RawHttpClient(host, port, timeout_s)
    if kind == "aiohttp":
        return AiohttpClient(host, port, timeout_s)
    raise ValueError(f"unknown HTTP client {kind!r}; one of {', '.join(CLIENT_KINDS)}")
