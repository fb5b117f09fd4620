"""The saga store in PostgreSQL (the ``SagaStore`` port, ``service/ports.py``): one statement to load a
saga with its key's stored outcome, one to commit a transition (``projections/saga_state.py``)."""

from __future__ import annotations

from datetime import datetime

import asyncpg

from eventstore.saga_payloads import saga_event_payload
from projections.saga_state import commit_saga, load_saga
from service.database import connection
from service.ports import CommitConflict, SagaPlan, SagaSnapshot, StoredOutcome, StreamTaken

# The constraint a saga's first event breaks when its stream id already holds another stream's events.
_STREAM_VERSION_KEY = "events_stream_version_key"


class PostgresSagaStore:
    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float) -> None:
        self._pool = pool
        self._timeout_s = acquire_timeout_s

    async def load(self, saga_id: str, principal: str, key: str | None) -> SagaSnapshot:
        async with connection(self._pool, self._timeout_s) as conn:
            row, stored = await load_saga(conn, saga_id, principal, key)
        return SagaSnapshot(row, None if stored is None else StoredOutcome(stored[0], stored[1]))

    async def commit(self, plan: SagaPlan) -> datetime | None:
        try:
            async with connection(self._pool, self._timeout_s) as conn:
                return await commit_saga(
                    conn,
                    expected=plan.expected_version,
                    new_state=plan.new_state,
                    events=[(event.type, saga_event_payload(event)) for event in plan.events],
                    metadata=plan.metadata,
                    principal=plan.idempotency.principal,
                    key=plan.idempotency.key,
                    fingerprint=plan.idempotency.fingerprint,
                    response=plan.response,
                )
        except asyncpg.UniqueViolationError as error:
            if error.constraint_name == _STREAM_VERSION_KEY:
                raise StreamTaken(str(error)) from error
            raise CommitConflict(str(error)) from error
