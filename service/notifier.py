"""What wakes waiting acquires, in PostgreSQL (the ``Notifier`` port, ``service/ports.py``).

One statement asks ``lock_state`` which of the awaited locks are free or past their deadline by the
database clock. ``lock_state`` is updated in the same transaction as each append, so reading it follows
the log for exactly these streams; the waiters ask only while someone waits (DESIGN: no NOTIFY in the
append).
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from projections.lock_state import lapsed_sql
from service.database import connection
from service.ports import NotifierUnavailable

FREED_SQL = f"""
SELECT resource FROM lock_state
 WHERE resource = ANY($1::text[]) AND (status <> 'held' OR {lapsed_sql("expires_at", "clock_timestamp()")})
"""


class PostgresNotifier:
    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float) -> None:
        self._pool = pool
        self._acquire_timeout_s = acquire_timeout_s

    async def freed(self, resources: Sequence[str]) -> list[str]:
        try:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                rows = await conn.fetch(FREED_SQL, list(resources))
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as error:
            raise NotifierUnavailable(str(error)) from error
        return [row["resource"] for row in rows]
