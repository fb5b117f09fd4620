"""Resolving a bearer token to its principal without a database round trip per request.

The hot path budget is one or two round trips per command (docs/architecture.md); a token lookup on
every request would add one more. So each process remembers the tokens it has seen, and instead of
looking each one up again when a cache entry ages out (which, with heartbeats every ttl/3, would be
nearly every renew), it asks the database every ``poll_s`` seconds for one thing only: which tokens
were revoked lately. One query per process per interval, whatever the fleet's size; a revoked token
works for at most ``poll_s`` more (default 10 s), which SECURITY.md states. Unknown tokens are
remembered for a second, so a client hammering with a bad token costs one lookup per second, not one
per request.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import asyncpg
import structlog

from domain.access import Principal
from service import tokens
from service.database import connection
from service.database_guard import DatabaseGuard

log = structlog.get_logger("lockledger.auth")

_UNKNOWN_TTL_S = 1.0
_MAX_KNOWN = 262_144  # beyond this the oldest entries are dropped and looked up again when used
# revoked_at is the revoking transaction's start; re-reading a minute back covers any commit still in
# flight at the previous poll (the service's statements are bounded far below that).
_OVERLAP = timedelta(seconds=60)
# If polls keep failing, stop trusting what is cached rather than honour revoked tokens indefinitely.
_STALE_AFTER_POLLS = 3


class Authenticator:
    def __init__(
        self,
        pool: asyncpg.Pool,
        guard: DatabaseGuard,
        *,
        poll_s: float = 10.0,
        acquire_timeout_s: float = 2.0,
    ) -> None:
        self._pool = pool
        self._guard = guard
        self._poll_s = poll_s
        self._acquire_timeout_s = acquire_timeout_s
        self._known: dict[bytes, Principal] = {}
        self._unknown: dict[bytes, float] = {}
        self._polled_at = time.monotonic()  # the cache starts empty, so it starts current
        self._revoked_since = datetime.now(UTC) - _OVERLAP
        self._poll: asyncio.Task[None] | None = None

    def forget_all(self) -> None:
        """Drop every cached lookup (after a revocation through this process)."""
        self._known.clear()
        self._unknown.clear()

    async def authenticate(self, token: str) -> Principal | None:
        """The token's principal, or None when it is malformed, unknown or revoked."""
        if not tokens.looks_like_a_token(token):
            return None
        now = time.monotonic()
        if now - self._polled_at >= self._poll_s:
            await self._poll_revocations()
        key = tokens.digest(token)
        principal = self._known.get(key)
        if principal is not None:
            return principal
        if self._unknown.get(key, 0.0) > now:
            return None

        async def lookup() -> Principal | None:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                return await tokens.find(conn, token)

        principal = await self._guard.run(lookup)
        if principal is None:
            if len(self._unknown) >= _MAX_KNOWN:
                self._unknown.clear()
            self._unknown[key] = now + _UNKNOWN_TTL_S
            return None
        if len(self._known) >= _MAX_KNOWN:
            del self._known[next(iter(self._known))]
        self._known[key] = principal
        return principal

    async def _poll_revocations(self) -> None:
        """Evict tokens revoked since the last poll; concurrent callers share one query."""
        if self._poll is None:
            self._poll = asyncio.create_task(self._fetch_revocations())
        poll = self._poll
        try:
            await asyncio.shield(poll)
        except Exception as error:  # the request goes on; commands meet the same database anyway
            log.warning("revocation poll failed", error=repr(error))
            if time.monotonic() - self._polled_at >= _STALE_AFTER_POLLS * self._poll_s:
                self._known.clear()
        finally:
            if self._poll is poll and poll.done():
                self._poll = None

    async def _fetch_revocations(self) -> None:
        async def fetch() -> tuple[datetime, list[bytes]]:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                return await tokens.revoked_since(conn, self._revoked_since)

        db_now, revoked = await self._guard.run(fetch)
        for key in revoked:
            self._known.pop(key, None)
        self._revoked_since = db_now - _OVERLAP
        self._polled_at = time.monotonic()
