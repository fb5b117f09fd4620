"""Where the command path keeps lock streams: the ``LockStore`` interface and its two stores.

A store loads what a decision needs (the stream head, a clock, the Idempotency-Key's stored outcome) and
commits a decision's plan, both for many commands at once (a batch of one is a batch). ``commit`` keeps
every rule of ``service/lock_store.py``: a plan stands only if its stream is still at the expected
version and, for a renew or release, its lease is still live by the store's clock at that instant; the
store stamps a grant's deadline from that clock (``domain.events.stamp``) and builds and keeps the
response under the Idempotency-Key. ``PostgresStore`` is the product; ``MemoryStore`` keeps the same
contract in a process (``tests/service/test_store_contract.py`` runs one suite against both). The
performance machinery wraps a store as adapters with the same interface (``service/store_adapters.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Protocol

import asyncpg

from domain.events import DEADLINE_FIELD, GRANTING_EVENTS, LOCK_ACQUIRED, Event, stamp
from domain.state import LockState, Status, initial_state, is_expired
from domain.timestamps import format_timestamp
from domain.value import value
from service import lock_store
from service.database import connection
from service.lock_store import AppendPlan, Committed, Snapshot, StoredOutcome


@value
class LoadRequest:
    """What one command needs loaded. ``remembered_if``: a remembered state with that status will do (an
    adapter may answer from memory, ``service/store_adapters.py``); None: read the store."""

    resource: str
    principal: str
    key: str | None
    remembered_if: Status | None = None

    def read_first(self) -> LoadRequest:
        """This request, never answered from memory."""
        if self.remembered_if is None:
            return self
        return LoadRequest(self.resource, self.principal, self.key)


class CommitConflict(Exception):
    """A commit lost a race the version check does not catch: its Idempotency-Key was taken, or its new
    stream created, concurrently. It wrote nothing; the next load sees the winner."""


class LockStore(Protocol):
    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        """For each request, in order: the stream head, the store's clock, any stored outcome of the key."""
        ...

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        """Commit each plan (distinct resources and keys), in order; None for a plan whose stream moved on
        or whose lease lapsed (it wrote nothing). Raises ``CommitConflict`` having written nothing."""
        ...


class PostgresStore:
    """The store in PostgreSQL: one statement per call (``service/lock_store.py``), on a pooled connection."""

    def __init__(self, pool: asyncpg.Pool, acquire_timeout_s: float) -> None:
        self._pool = pool
        self._acquire_timeout_s = acquire_timeout_s

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        async with connection(self._pool, self._acquire_timeout_s) as conn:
            return await lock_store.load_many(conn, [(r.resource, r.principal, r.key) for r in requests])

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        try:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                return await lock_store.commit_many(conn, list(plans))
        except asyncpg.UniqueViolationError as error:
            raise CommitConflict(str(error)) from error


@value
class _Head:
    state: LockState
    acquired_at: datetime | None


class MemoryStore:
    """The store in this process's memory, for tests and for running without a database. ``clock`` is
    its clock (the database's, in ``PostgresStore``)."""

    def __init__(self, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self._clock = clock
        self._heads: dict[str, _Head] = {}
        self._keys: dict[tuple[str, str], StoredOutcome] = {}
        self.events: dict[str, list[Event]] = {}  # the log, per stream

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        now = self._clock()
        snapshots = []
        for request in requests:
            head = self._heads.get(request.resource)
            stored = None if request.key is None else self._keys.get((request.principal, request.key))
            state = head.state if head is not None else initial_state(request.resource)
            snapshots.append(Snapshot(db_now=now, state=state, stored=stored))
        return snapshots

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        for plan in plans:  # a key taken fails the whole call before anything is written, as in SQL
            idempotency = plan.idempotency
            if idempotency.key is not None and (idempotency.principal, idempotency.key) in self._keys:
                raise CommitConflict(f"Idempotency-Key {idempotency.key!r} is taken")
        now = self._clock()
        return [self._commit_one(plan, now) for plan in plans]

    def _commit_one(self, plan: AppendPlan, now: datetime) -> Committed | None:
        resource = plan.new_state.resource
        head = self._heads.get(resource)
        if (head.state.version if head is not None else 0) != plan.expected_version:
            return None
        if plan.require_live:
            deadline = head.state.expires_at if head is not None else None
            if deadline is None or is_expired(deadline, now):
                return None
        events = stamp(plan.events, now)
        new_state = plan.new_state.with_deadline(events[-1].expires_at)
        acquired = any(event.type == LOCK_ACQUIRED for event in events)
        self._heads[resource] = _Head(
            new_state, now if acquired else (head.acquired_at if head is not None else None)
        )
        self.events.setdefault(resource, []).extend(events)
        idempotency = plan.idempotency
        if idempotency.key is not None:
            response = dict(plan.response)
            if events[-1].type in GRANTING_EVENTS and new_state.expires_at is not None:
                response[DEADLINE_FIELD] = format_timestamp(new_state.expires_at)
            self._keys[(idempotency.principal, idempotency.key)] = StoredOutcome(
                idempotency.fingerprint, json.dumps(response)
            )
        return Committed(new_state.expires_at)
