"""The lock store in memory (the ``LockStore`` port): ``PostgresStore``'s contract kept in a process."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from domain.events import DEADLINE_FIELD, GRANTING_EVENTS, stamp
from domain.state import initial_state, is_expired
from domain.timestamps import format_timestamp
from service.fakes.database import MemoryDatabase
from service.ports import AppendPlan, CommitConflict, Committed, LoadRequest, Snapshot, StoredOutcome


class MemoryLockStore:
    def __init__(self, database: MemoryDatabase) -> None:
        self._db = database

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        now = self._db.clock.now()
        return [
            Snapshot(
                db_now=now,
                state=self._db.locks.get(request.resource) or initial_state(request.resource),
                stored=self._db.stored(request.principal, request.key),
            )
            for request in requests
        ]

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        for plan in plans:  # a key taken fails the whole call before anything is written, as in SQL
            if self._db.key_taken(plan.idempotency.principal, plan.idempotency.key):
                raise CommitConflict(f"Idempotency-Key {plan.idempotency.key!r} is taken")
        now = self._db.clock.now()
        return [self.commit_one(plan, now) for plan in plans]

    def commit_one(self, plan: AppendPlan, now: datetime) -> Committed | None:
        """``plan`` at instant ``now``, by the commit's rules (the reaper's fake appends through it too)."""
        resource = plan.new_state.resource
        head = self._db.locks.get(resource)
        if (head.version if head is not None else 0) != plan.expected_version:
            return None
        if plan.require_live:
            deadline = head.expires_at if head is not None else None
            if deadline is None or is_expired(deadline, now):
                return None
        events = stamp(plan.events, now)
        new_state = plan.new_state.with_deadline(events[-1].expires_at)
        self._db.locks[resource] = new_state
        self._db.events.setdefault(resource, []).extend(events)
        idempotency = plan.idempotency
        if idempotency.key is not None:
            response = dict(plan.response)
            if events[-1].type in GRANTING_EVENTS and new_state.expires_at is not None:
                response[DEADLINE_FIELD] = format_timestamp(new_state.expires_at)
            outcome = StoredOutcome(idempotency.fingerprint, json.dumps(response))
            self._db.keep(idempotency.principal, idempotency.key, outcome, now)
        return Committed(new_state.expires_at)
