"""The ``eventsourcing`` library baseline: its PostgreSQL recorder, driven by W threads.

The library is synchronous (psycopg), so each agent's command runs on a thread of a pool of W threads
(``run_in_executor``); the agents themselves are the same asyncio tasks as for every other target.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from bench.targets.base import Agent, CommandFailed, Safety
from bench.targets.es_model import LockApp, NotHolderError


def postgres_env(url: str, pool_size: int) -> dict[str, str]:
    """The library's POSTGRES_* settings for a ``postgresql://`` URL (a socket directory works as host)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
    return {
        "PERSISTENCE_MODULE": "eventsourcing.postgres",
        "POSTGRES_DBNAME": unquote(parts.path.lstrip("/")),
        "POSTGRES_HOST": host,
        "POSTGRES_PORT": str(query.get("port", [parts.port or 5432])[0]),
        "POSTGRES_USER": unquote(parts.username or "postgres"),
        "POSTGRES_PASSWORD": unquote(parts.password or ""),
        "POSTGRES_POOL_SIZE": str(pool_size),
        "POSTGRES_MAX_OVERFLOW": "0",
        "POSTGRES_CONNECT_TIMEOUT": "30",
        # The library's aggregate cache with fast-forward: a command reads only the events it has not
        # seen, not the whole stream (the library's own answer to long streams in the hot mode).
        "AGGREGATE_CACHE_MAXSIZE": "200000",
        "AGGREGATE_CACHE_FASTFORWARD": "y",
    }


class EsAgent:
    def __init__(self, target: EventsourcingTarget, owner: str) -> None:
        self._target = target
        self._owner = owner

    async def acquire(self, resource: str) -> Any | None:
        return await self._target.call(self._target.app.acquire, resource, self._owner, self._target.ttl_ms)

    async def renew(self, resource: str, token: Any) -> None:
        await self._target.call(self._target.app.renew, resource, self._owner, token, self._target.ttl_ms)

    async def release(self, resource: str, token: Any) -> None:
        await self._target.call(self._target.app.release, resource, self._owner, token)


class EventsourcingTarget:
    name = "eventsourcing"
    safety = Safety(exclusive=True, monotonic_tokens=True)

    def __init__(self, url: str, pool_size: int, ttl_ms: int) -> None:
        self._env = postgres_env(url, pool_size)
        self.ttl_ms = ttl_ms
        self._app: LockApp | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def app(self) -> LockApp:
        assert self._app is not None
        return self._app

    async def call(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except NotHolderError as error:
            raise CommandFailed(f"not the holder of {error}") from None

    async def open(self) -> None:
        self._app = await asyncio.to_thread(LockApp, self._env)  # creates its tables

    async def start_cell(self, workers: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="es-agent")

    def agent(self, index: int) -> Agent:
        return EsAgent(self, f"agent-{index}")

    async def end_cell(self) -> None:
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True)
            self._executor = None

    async def close(self) -> None:
        await self.end_cell()
        if self._app is not None:
            self._app.close()
            self._app = None

    def describe(self) -> dict[str, Any]:
        settings = {k: v for k, v in self._env.items() if k != "POSTGRES_PASSWORD"}
        import psycopg

        return {
            "library": f"eventsourcing {version('eventsourcing')}",
            "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__})",
            "threads": "W",
            "env": settings,
        }
