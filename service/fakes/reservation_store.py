"""A reservation's commit in memory (the ``AtomicLockStore`` port): every plan by the lock store's rules,
all or none, as ``PostgresReservationStore`` commits them in one transaction."""

from __future__ import annotations

from collections.abc import Sequence

from domain.state import is_expired
from service.fakes.database import MemoryDatabase
from service.fakes.lock_store import MemoryLockStore
from service.ports import AppendPlan, CommitConflict, Committed


class MemoryReservationStore:
    def __init__(self, database: MemoryDatabase) -> None:
        self._db = database
        self._locks = MemoryLockStore(database)

    async def commit_all(self, plans: Sequence[AppendPlan]) -> list[Committed] | None:
        now = self._db.clock.now()
        for plan in plans:
            if self._db.key_taken(plan.idempotency.principal, plan.idempotency.key):
                raise CommitConflict(f"Idempotency-Key {plan.idempotency.key!r} is taken")
            head = self._db.locks.get(plan.new_state.resource)
            if (head.version if head is not None else 0) != plan.expected_version:
                return None
            if plan.require_live and (
                head is None or head.expires_at is None or is_expired(head.expires_at, now)
            ):
                return None
        committed = [self._locks.commit_one(plan, now) for plan in plans]
        return [result for result in committed if result is not None]
