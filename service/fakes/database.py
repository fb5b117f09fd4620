"""The state the in-memory fakes share, as PostgreSQL's tables are shared by its adapters: lock heads,
saga heads, the Idempotency-Keys (one table for locks and sagas), the log, and the clock."""

from __future__ import annotations

from datetime import datetime

from domain.events import Event
from domain.saga import SagaEvent
from domain.state import LockState
from projections.saga_state import SagaRow
from service.clock import SystemClock
from service.ports import Clock, StoredOutcome


class MemoryDatabase:
    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.locks: dict[str, LockState] = {}
        self.sagas: dict[str, SagaRow] = {}
        self.keys: dict[tuple[str, str], tuple[StoredOutcome, datetime]] = {}  # and when each was kept
        self.events: dict[str, list[Event]] = {}  # the log of lock streams, per stream
        self.saga_events: dict[str, list[SagaEvent]] = {}  # the log of saga streams, per stream

    def stored(self, principal: str, key: str | None) -> StoredOutcome | None:
        """What ``key`` already produced for ``principal``."""
        if key is None:
            return None
        found = self.keys.get((principal, key))
        return None if found is None else found[0]

    def key_taken(self, principal: str, key: str | None) -> bool:
        return key is not None and (principal, key) in self.keys

    def keep(self, principal: str, key: str, outcome: StoredOutcome, at: datetime) -> None:
        self.keys[(principal, key)] = (outcome, at)
