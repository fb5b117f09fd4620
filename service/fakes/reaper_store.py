"""What a reaper pass does, in memory (the ``ReaperStore`` port): ``PostgresReaperStore``'s contract in a
process. A process has no outage to wait out, so the outage threshold changes nothing here."""

from __future__ import annotations

from datetime import timedelta

from domain.commands import Expire
from domain.decider import decide, fold
from domain.state import is_expired
from service.fakes.database import MemoryDatabase
from service.fakes.lock_store import MemoryLockStore
from service.ports import AppendPlan, DueSaga, Expiry, Idempotency


class MemoryReaperStore:
    def __init__(self, database: MemoryDatabase) -> None:
        self._db = database
        self._locks = MemoryLockStore(database)

    async def expire_due(self, batch_size: int, reaper_id: str, outage_after_ms: int | None) -> list[Expiry]:
        now = self._db.clock.now()
        due = sorted(
            (state for state in self._db.locks.values() if state.status == "held" and state.expires_at),
            key=lambda state: state.expires_at or now,
        )
        expiries: list[Expiry] = []
        for state in due:
            if (
                len(expiries) == batch_size
                or state.expires_at is None
                or not is_expired(state.expires_at, now)
            ):
                break
            events = decide(state, Expire(state.resource), now)
            plan = AppendPlan(
                expected_version=state.version,
                events=events,
                new_state=fold(state, events),
                require_live=False,
                response={},
                metadata={"command": "expire", "actor": "reaper", "reaper_id": reaper_id},
                idempotency=Idempotency("reaper", None, b""),
            )
            self._locks.commit_one(plan, now)
            expiries.append(Expiry(state.resource, state.fencing_token, state.expires_at, now))
        return expiries

    async def due_sagas(self, limit: int) -> list[DueSaga]:
        now = self._db.clock.now()
        due = [
            row.state
            for row in self._db.sagas.values()
            if row.state.lease_expires_at is not None and row.state.lease_expires_at <= now
        ]
        due.sort(key=lambda state: state.lease_expires_at or now)
        return [DueSaga(state.saga_id, now) for state in due[:limit]]

    async def purge_keys(self, retention_s: int, batch: int) -> int:
        cutoff = self._db.clock.now() - timedelta(seconds=retention_s)
        old = sorted((at, key) for key, (_, at) in self._db.keys.items() if at < cutoff)[:batch]
        for _, key in old:
            del self._db.keys[key]
        return len(old)

    async def purge_tickets(self, batch: int) -> int:
        """The fakes keep no queue (their waiters take turns in this process): nothing to purge."""
        return 0

    async def create_partitions(self, interval: str, ahead: int) -> int:
        """The process's log is one list: nothing to partition."""
        return 0
