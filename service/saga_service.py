"""The saga use case: load the saga, decide, append and project in one statement, and on a lost race load
and decide again (bounded).

Idempotency-Keys share the lock commands' table and rules (``service/idempotency.py``): the key is scoped
to the principal, the fingerprint is a digest of the transition as decided (its name, the saga's stream
and its fields), and the answer is stored by the same statement that appends the events. A repeated key
with the same request returns the stored answer and appends nothing; with another request, 422. A
transition that changes nothing (it already happened) appends nothing and stores nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any

import asyncpg

from domain.saga import (
    AbortSaga,
    CompleteCompensation,
    CompleteSaga,
    CompleteStep,
    FailCompensation,
    FailStep,
    SagaCommand,
    SagaState,
    StartCompensation,
    StartSaga,
    StartStep,
    decide,
    fold,
    stream_id,
)
from domain.timestamps import format_timestamp
from domain.value import value
from eventstore.saga_payloads import saga_event_payload
from projections.saga_state import SagaRow, commit_saga, load_saga
from service.database import connection
from service.database_guard import DatabaseGuard
from service.errors import Conflict, Unavailable
from service.idempotency import fingerprint, replay
from service.lock_store import StoredOutcome


@value
class SagaContext:
    """Who asks, and how the request ties into a wider flow (stored in each event's metadata)."""

    principal: str = "anonymous"
    idempotency_key: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None


@value
class SagaResult:
    view: dict[str, Any]  # the saga view, JSON-ready (timestamps as text)
    created: bool = False  # this request started the saga
    replayed: bool = False  # the stored answer of an earlier request with the same Idempotency-Key


def saga_view(state: SagaState, started_at: str | None, updated_at: str | None) -> dict[str, Any]:
    """The saga as the API shows it (timestamps already written as every answer writes them)."""
    return rendered(_stored_view(state, started_at, updated_at))


def rendered(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored view as the API shows it: each step's result, kept as JSON text, as the object it is."""
    steps = [
        {**step, "result": None if step["result"] is None else json.loads(step["result"])}
        for step in stored["steps"]
    ]
    return {**stored, "steps": steps}


def _stored_view(state: SagaState, started_at: str | None, updated_at: str | None) -> dict[str, Any]:
    """The view as an Idempotency-Key keeps it: results as the JSON text they are stored as (jsonb
    cannot hold every JSON string, a NUL for one)."""
    return {
        "saga_id": state.saga_id,
        "name": state.name,
        "owner": state.owner,
        "policy": state.policy,
        "status": state.status,
        "reason": state.reason,
        "steps": [
            {
                "name": step.name, "locks": list(step.locks), "status": step.status,
                "result": step.result, "error": step.error,
                "compensation_failures": step.compensation_failures,
            }
            for step in state.steps
        ],
        "version": state.version,
        "started_at": started_at,
        "updated_at": updated_at,
    }  # fmt: skip


def row_view(row: SagaRow) -> dict[str, Any]:
    return saga_view(row.state, _text(row.started_at), _text(row.updated_at))


def _text(instant: datetime | None) -> str | None:
    return None if instant is None else format_timestamp(instant)


class SagaService:
    def __init__(
        self,
        pool: asyncpg.Pool,
        guard: DatabaseGuard,
        *,
        acquire_timeout_s: float = 5.0,
        conflict_retries: int = 16,
    ) -> None:
        self._pool = pool
        self._guard = guard
        self._timeout_s = acquire_timeout_s
        self._retries = conflict_retries

    async def execute(
        self,
        command: SagaCommand,
        ctx: SagaContext,
        allowed: Callable[[SagaState], None] | None = None,
    ) -> SagaResult:
        """Run ``command`` to a decision that is committed, changes nothing, is refused (DomainError) or
        replayed. ``allowed`` is asked about the saga as loaded (it raises to refuse: another's saga)."""
        name, fields = _describe(command)
        stream = stream_id(command.saga_id)
        digest = fingerprint(name, stream, fields)
        metadata = _metadata(name, command.saga_id, ctx)
        for _ in range(self._retries + 1):
            row, stored = await self._guard.run(partial(self._load, command.saga_id, ctx))
            if row.state.status is not None and allowed is not None:
                allowed(row.state)
            if stored is not None:
                answer = replay(StoredOutcome(stored[0], stored[1]), digest)
                view = rendered(json.loads(answer))
                return SagaResult(view, created=isinstance(command, StartSaga), replayed=True)
            events = decide(row.state, command)
            if not events:
                return SagaResult(row_view(row))
            new_state = fold(row.state, events)
            started_at = _text(row.started_at)
            response = _stored_view(new_state, started_at, None)
            try:
                commit = partial(
                    self._commit, row.state.version, new_state, events, metadata, ctx, digest, response
                )
                ts = await self._guard.run(commit)
            except asyncpg.UniqueViolationError as error:
                if error.constraint_name == "events_stream_version_key":
                    raise Conflict(f"the stream {stream} is taken by a lock, not a saga") from error
                continue  # the key was taken by a concurrent request: the next load finds its answer
            if ts is None:
                continue  # the saga moved on: decide again on what it is now
            stamp = format_timestamp(ts)
            view = saga_view(new_state, started_at or stamp, stamp)
            return SagaResult(view, created=isinstance(command, StartSaga))
        raise Unavailable(f"saga {command.saga_id} is too contended to decide now; retry", retry_after_s=1)

    async def _load(self, saga_id: str, ctx: SagaContext) -> tuple[SagaRow, tuple[bytes, str] | None]:
        async with connection(self._pool, self._timeout_s) as conn:
            return await load_saga(conn, saga_id, ctx.principal, ctx.idempotency_key)

    async def _commit(
        self,
        expected: int,
        new_state: SagaState,
        events: list[Any],
        metadata: dict[str, Any],
        ctx: SagaContext,
        digest: bytes,
        response: dict[str, Any],
    ) -> datetime | None:
        async with connection(self._pool, self._timeout_s) as conn:
            return await commit_saga(
                conn,
                expected=expected,
                new_state=new_state,
                events=[(event.type, saga_event_payload(event)) for event in events],
                metadata=metadata,
                principal=ctx.principal,
                key=ctx.idempotency_key,
                fingerprint=digest,
                response=response,
            )


def _describe(command: SagaCommand) -> tuple[str, dict[str, Any]]:
    """The transition's name and fields, for its fingerprint and its events' metadata."""
    if isinstance(command, StartSaga):
        steps = [{"name": step.name, "locks": list(step.locks)} for step in command.steps]
        return "saga-start", {
            "name": command.name, "owner": command.owner, "policy": command.policy, "steps": steps,
        }  # fmt: skip
    if isinstance(command, StartStep):
        return "step-start", {"step": command.step}
    if isinstance(command, CompleteStep):
        return "step-complete", {"step": command.step, "result": command.result}
    if isinstance(command, FailStep):
        return "step-fail", {"step": command.step, "reason": command.reason}
    if isinstance(command, StartCompensation):
        return "compensation-start", {"step": command.step}
    if isinstance(command, CompleteCompensation):
        return "compensation-complete", {"step": command.step}
    if isinstance(command, FailCompensation):
        return "compensation-fail", {"step": command.step, "reason": command.reason}
    if isinstance(command, CompleteSaga):
        return "saga-complete", {}
    assert isinstance(command, AbortSaga)
    return "saga-abort", {"reason": command.reason}


def _metadata(command: str, saga_id: str, ctx: SagaContext) -> dict[str, Any]:
    metadata: dict[str, Any] = {"command": command, "actor": ctx.principal, "saga_id": saga_id}
    for key in ("idempotency_key", "correlation_id", "causation_id"):
        found = getattr(ctx, key)
        if found is not None:
            metadata[key] = found
    return metadata
