"""The saga store in memory (the ``SagaStore`` port): ``PostgresSagaStore``'s contract in a process."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta

from domain.saga import SAGA_LEASE_EXPIRED, STREAM_PREFIX, initial_saga
from domain.timestamps import format_timestamp
from projections.saga_state import SagaRow
from service.fakes.database import MemoryDatabase
from service.ports import CommitConflict, SagaPlan, SagaSnapshot, StoredOutcome, StreamTaken


class MemorySagaStore:
    def __init__(self, database: MemoryDatabase) -> None:
        self._db = database

    async def load(self, saga_id: str, principal: str, key: str | None) -> SagaSnapshot:
        row = self._db.sagas.get(saga_id) or SagaRow(initial_saga(saga_id), None, None)
        return SagaSnapshot(row, self._db.stored(principal, key))

    async def commit(self, plan: SagaPlan) -> datetime | None:
        saga_id = plan.new_state.saga_id
        stream = STREAM_PREFIX + saga_id
        head = self._db.sagas.get(saga_id)
        if plan.expected_version == 0 and head is None and self._db.events.get(stream):  # a lock's
            raise StreamTaken(f"the stream {stream} holds another stream's events")
        if (head.state.version if head is not None else 0) != plan.expected_version:
            return None  # a plan that does not stand keeps no key either, as in SQL
        if self._db.key_taken(plan.idempotency.principal, plan.idempotency.key):
            raise CommitConflict(f"Idempotency-Key {plan.idempotency.key!r} is taken")
        ts = self._db.clock.now()
        new = plan.new_state
        unfinished = new.status in ("running", "compensating") and new.lease_ms is not None
        lease_expires_at = ts + timedelta(milliseconds=new.lease_ms or 0) if unfinished else None
        lapsed_at = None
        if head is not None and new.lease_lapsed:
            lapsed_now = any(event.type == SAGA_LEASE_EXPIRED for event in plan.events)
            lapsed_at = ts if lapsed_now else head.lease_lapsed_at
        state = dataclasses.replace(
            new, version=plan.expected_version + len(plan.events), lease_expires_at=lease_expires_at
        )
        started_at = ts if head is None else head.started_at
        self._db.sagas[saga_id] = SagaRow(state, started_at, ts, lapsed_at)
        self._db.saga_events.setdefault(stream, []).extend(plan.events)
        idempotency = plan.idempotency
        if idempotency.key is not None:
            response = {
                **plan.response,
                "updated_at": format_timestamp(ts),
                "lease_expires_at": None if lease_expires_at is None else format_timestamp(lease_expires_at),
            }
            if head is None:
                response["started_at"] = format_timestamp(ts)
            outcome = StoredOutcome(idempotency.fingerprint, json.dumps(response))
            self._db.keep(idempotency.principal, idempotency.key, outcome, ts)
        return ts
