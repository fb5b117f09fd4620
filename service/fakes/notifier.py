"""What wakes waiting acquires, in memory (the ``Notifier`` port): the fake store's heads, by its clock."""

from __future__ import annotations

from collections.abc import Sequence

from domain.state import is_expired
from service.fakes.database import MemoryDatabase


class MemoryNotifier:
    def __init__(self, database: MemoryDatabase) -> None:
        self._db = database

    async def freed(self, resources: Sequence[str]) -> list[str]:
        now = self._db.clock.now()
        freed = []
        for resource in resources:
            head = self._db.locks.get(resource)
            if head is None:
                continue  # never appended to: no lock_state row, as in SQL
            lapsed = head.expires_at is not None and is_expired(head.expires_at, now)
            if head.status != "held" or lapsed:
                freed.append(resource)
        return freed
