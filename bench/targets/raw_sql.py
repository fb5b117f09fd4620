"""The floor of any PostgreSQL lock: a lease table driven by asyncpg, one statement per command.

Acquire is one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE the lease lapsed RETURNING token``: it takes a
free or lapsed lease and bumps the fencing token, or returns no row when the lease is live. Release and
renew are one ``UPDATE`` each, matched on resource, owner and token. Leases are kept (not deleted) on
release so the token keeps increasing; deadlines use the database clock like lockledger's.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from bench.targets.base import Agent, CommandFailed, Safety

TABLE = "bench_leases"

CREATE_SQL = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    resource   text PRIMARY KEY,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL
)
"""

ACQUIRE_SQL = f"""
INSERT INTO {TABLE} AS l (resource, owner, token, expires_at)
VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 millisecond')
ON CONFLICT (resource) DO UPDATE
   SET owner = EXCLUDED.owner, token = l.token + 1, expires_at = EXCLUDED.expires_at
 WHERE l.expires_at <= clock_timestamp()
RETURNING token
"""

RENEW_SQL = f"""
UPDATE {TABLE} SET expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
 WHERE resource = $1 AND owner = $2 AND token = $3 AND expires_at > clock_timestamp()
RETURNING token
"""

RELEASE_SQL = f"""
UPDATE {TABLE} SET expires_at = '-infinity'
 WHERE resource = $1 AND owner = $2 AND token = $3 AND expires_at > clock_timestamp()
RETURNING token
"""


class RawSqlAgent:
    def __init__(self, pool: asyncpg.Pool, owner: str, ttl_ms: int) -> None:
        self._pool = pool
        self._owner = owner
        self._ttl_ms = ttl_ms

    async def acquire(self, resource: str) -> Any | None:
        return await self._pool.fetchval(ACQUIRE_SQL, resource, self._owner, self._ttl_ms)

    async def renew(self, resource: str, token: Any) -> None:
        if await self._pool.fetchval(RENEW_SQL, resource, self._owner, token, self._ttl_ms) is None:
            raise CommandFailed(f"renew of {resource} token {token}: not the holder")

    async def release(self, resource: str, token: Any) -> None:
        if await self._pool.fetchval(RELEASE_SQL, resource, self._owner, token) is None:
            raise CommandFailed(f"release of {resource} token {token}: not the holder")


class RawSqlTarget:
    name = "raw-sql"
    safety = Safety(exclusive=True, monotonic_tokens=True)

    def __init__(self, dsn: str, pool_size: int, ttl_ms: int) -> None:
        self._dsn = dsn
        self._pool_size = pool_size
        self._ttl_ms = ttl_ms
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(
            self._dsn, min_size=self._pool_size, max_size=self._pool_size, command_timeout=10
        )
        assert self._pool is not None
        await self._pool.execute(CREATE_SQL)

    async def start_cell(self, workers: int) -> None:
        pass

    def agent(self, index: int) -> Agent:
        assert self._pool is not None
        return RawSqlAgent(self._pool, f"agent-{index}", self._ttl_ms)

    async def end_cell(self) -> None:
        pass

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def describe(self) -> dict[str, Any]:
        return {"driver": "asyncpg", "pool_size": self._pool_size, "table": TABLE}
