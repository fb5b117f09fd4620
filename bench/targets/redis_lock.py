"""Redis: ``SET key token NX PX ttl`` to acquire, a compare-and-delete script to release.

The classic single-instance Redis lock. Its tokens are unique but not ordered, so the hot mode checks
exclusivity only. Skipped (with a note) when nothing answers at the configured address.
"""

from __future__ import annotations

from itertools import count
from typing import Any

import psutil
import redis.asyncio as aioredis

from bench.targets.base import Agent, CommandFailed, Safety

RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end
"""
RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end
"""


async def redis_answers(url: str, timeout_s: float = 1.0) -> str | None:
    """Redis's version when it answers a PING at ``url``, else None."""
    client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        await client.ping()
        info = await client.info("server")
        return str(info.get("redis_version", "?"))
    except (aioredis.RedisError, OSError):
        return None
    finally:
        await client.aclose()


class RedisAgent:
    def __init__(self, target: RedisTarget, owner: str) -> None:
        self._target = target
        self._owner = owner
        self._grants = count(1)

    async def acquire(self, resource: str) -> Any | None:
        token = f"{self._owner}:{next(self._grants)}"
        ok = await self._target.client.set(self._target.key(resource), token, nx=True, px=self._target.ttl_ms)
        return token if ok else None

    async def renew(self, resource: str, token: Any) -> None:
        keys, args = [self._target.key(resource)], [token, self._target.ttl_ms]
        if not await self._target.renew_script(keys=keys, args=args):
            raise CommandFailed(f"renew of {resource}: not the holder")

    async def release(self, resource: str, token: Any) -> None:
        if not await self._target.release_script(keys=[self._target.key(resource)], args=[token]):
            raise CommandFailed(f"release of {resource}: not the holder")


class RedisTarget:
    name = "redis"
    safety = Safety(exclusive=True, monotonic_tokens=False)

    def __init__(self, url: str, run_id: str, ttl_ms: int) -> None:
        self._url = url
        self._prefix = f"lockledger-bench:{run_id}:"
        self.ttl_ms = ttl_ms
        self._client: aioredis.Redis | None = None
        self.version: str | None = None

    @property
    def client(self) -> aioredis.Redis:
        assert self._client is not None
        return self._client

    def key(self, resource: str) -> str:
        return self._prefix + resource

    async def open(self) -> None:
        self.version = await redis_answers(self._url)

    async def start_cell(self, workers: int) -> None:
        # One connection per agent at most (redis-py's pool refuses more than max_connections).
        self._client = aioredis.Redis.from_url(self._url, socket_timeout=10, max_connections=workers)
        self.release_script = self._client.register_script(RELEASE_LUA)
        self.renew_script = self._client.register_script(RENEW_LUA)

    def agent(self, index: int) -> Agent:
        return RedisAgent(self, f"agent-{index}")

    async def end_cell(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def close(self) -> None:
        await self.end_cell()

    def describe(self) -> dict[str, Any]:
        return {"client": "redis-py asyncio", "url": self._url, "redis_version": self.version}


async def redis_pid(url: str) -> int | None:
    """The Redis server's process id (from INFO), to sample its CPU when it runs on this machine."""
    client = aioredis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        info = await client.info("server")
        pid = int(info["process_id"])
        return pid if psutil.Process(pid).name().startswith("redis") else None  # this machine's Redis?
    except (aioredis.RedisError, OSError, KeyError, ValueError, psutil.Error):
        return None
    finally:
        await client.aclose()
