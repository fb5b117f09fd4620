"""How the fleet's agents talk to the server.

Each agent has its own API token (``bench.auth``: minted in one statement before its scenario; its name
owns the agent's leases) and a handle on one shared aiohttp session (``bench.http_client``) that keeps at
most ``connections`` sockets open, since thousands of agents take turns on them. A request returns
(status, body, seconds); status 0 is a failure below HTTP (connection error, timeout), which an agent
retries with the same Idempotency-Key, as a well-behaved agent does.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import aiohttp

from bench.auth import mint_agent_tokens
from bench.http_client import AiohttpClient

TIMEOUT_S = 30.0
RETRYABLE = frozenset({0, 502, 503, 504})


async def mint_tokens(database_url: str, names: list[str]) -> tuple[list[str], dict[str, Any]]:
    """One agent token per name (in the order of ``names``), and what minting them took."""
    started = time.perf_counter()
    tokens = await mint_agent_tokens(database_url, names)
    seconds = time.perf_counter() - started
    return tokens, {"minted": len(names), "seconds": round(seconds, 3)}


class Agents:
    """Agent i sends ``tokens[i]``; at most ``connections`` requests travel at once."""

    def __init__(
        self, host: str, port: int, tokens: Sequence[str], *, connections: int, timeout_s: float = TIMEOUT_S
    ) -> None:
        self._client = AiohttpClient(host, port, timeout_s, max_connections=connections)
        self._tokens = tokens

    async def __aenter__(self) -> Agents:
        await self._client.open(self._tokens)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()

    async def post(
        self, agent: int, path: str, body: dict[str, Any], key: str | None = None
    ) -> tuple[int, bytes, float]:
        """POST ``body`` as JSON with an Idempotency-Key (``key``, or a fresh one) as agent ``agent``."""
        data = json.dumps(body).encode()
        started = time.perf_counter()
        try:
            status, reply = await self._client.connection(agent).post(path, data, key or os.urandom(12).hex())
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0, b"", time.perf_counter() - started
        return status, reply, time.perf_counter() - started

    async def post_with_retries(
        self, agent: int, path: str, body: dict[str, Any], *, attempts: int = 3
    ) -> tuple[int, bytes, float]:
        """``post``, again with the same key after a transport error or a 502/503/504."""
        key = os.urandom(12).hex()
        status, data, seconds = 0, b"", 0.0
        for attempt in range(attempts):
            status, data, seconds = await self.post(agent, path, body, key)
            if status not in RETRYABLE:
                break
            await asyncio.sleep(0.05 * (attempt + 1))
        return status, data, seconds


async def bounded(concurrency: int, jobs: Iterable[Callable[[], Awaitable[None]]]) -> None:
    """Run the jobs with at most ``concurrency`` in flight (a fixed set of workers, no task per job)."""
    iterator = iter(jobs)

    async def worker() -> None:
        for job in iterator:
            await job()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def status_counts(counter: Counter[int]) -> dict[str, int]:
    """How many answers had each status, in status order, as JSON keys."""
    return {str(status): count for status, count in sorted(counter.items())}
