"""Resolving a bearer token to its principal without a database round trip per request.

The hot path budget is two round trips per command (docs/performance.md); a token lookup on every
request would add a third. Lookups are therefore cached for ``ttl_s`` (default 10 s): a revoked token
keeps working for at most that long in each server process, which docs/security and SECURITY.md state.
Unknown tokens are cached briefly too, so one client hammering with a bad token costs one lookup per
second, not one per request.
"""

from __future__ import annotations

import time

import asyncpg

from domain.access import Principal
from service import tokens
from service.database_guard import DatabaseGuard

_UNKNOWN_TTL_S = 1.0
_MAX_ENTRIES = 65_536


class Authenticator:
    def __init__(
        self, pool: asyncpg.Pool, guard: DatabaseGuard, *, ttl_s: float = 10.0, acquire_timeout_s: float = 2.0
    ) -> None:
        self._pool = pool
        self._guard = guard
        self._ttl_s = ttl_s
        self._acquire_timeout_s = acquire_timeout_s
        self._cache: dict[bytes, tuple[Principal | None, float]] = {}

    def forget_all(self) -> None:
        """Drop every cached lookup (after a revocation through this process)."""
        self._cache.clear()

    async def authenticate(self, token: str) -> Principal | None:
        """The token's principal, or None when it is malformed, unknown or revoked."""
        if not tokens.looks_like_a_token(token):
            return None
        key = tokens.digest(token)
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]

        async def lookup() -> Principal | None:
            async with self._pool.acquire(timeout=self._acquire_timeout_s) as conn:
                return await tokens.find(conn, token)

        principal = await self._guard.run(lookup)
        if len(self._cache) >= _MAX_ENTRIES:
            self._cache.clear()  # rare, and only costs a lookup per live token
        self._cache[key] = (principal, now + (self._ttl_s if principal is not None else _UNKNOWN_TTL_S))
        return principal
