"""The saga use case: load the saga, decide, commit the transition through the ``SagaStore`` port
(``service/ports.py``; in PostgreSQL one statement appends and projects, ``service/saga_store.py``), and
on a lost race load and decide again (bounded).

Idempotency-Keys share the lock commands' store and rules (``service/idempotency.py``): the key is scoped
to the principal, the fingerprint is a digest of the transition as decided (its name, the saga's stream
and its fields), and the answer is kept by the same commit that appends the events. A repeated key
with the same request returns the stored answer and appends nothing; with another request, 422. A
transition that changes nothing (it already happened) appends nothing and stores nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from domain.saga import (
    AbortSaga,
    CompleteCompensation,
    CompleteSaga,
    CompleteStep,
    ExpireSagaLease,
    FailCompensation,
    FailStep,
    RenewSagaLease,
    SagaCommand,
    SagaLeaseExpired,
    SagaState,
    StartCompensation,
    StartSaga,
    StartStep,
    decide,
    fold,
    step_fields,
    stream_id,
)
from domain.timestamps import format_timestamp
from domain.value import value
from projections.saga_state import SagaRow
from service.database_guard import DatabaseGuard
from service.errors import Conflict, Unavailable
from service.idempotency import fingerprint, replay
from service.ports import CommitConflict, Idempotency, SagaPlan, SagaStore, StreamTaken


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
    changed: bool = False  # this request appended events


@value
class LeaseTimes:
    """The saga lease's two instants, as every answer writes them (None: no lease, or not lapsed)."""

    expires_at: str | None = None
    lapsed_at: str | None = None


def saga_view(
    state: SagaState, started_at: str | None, updated_at: str | None, lease: LeaseTimes
) -> dict[str, Any]:
    """The saga as the API shows it (timestamps already written as every answer writes them)."""
    return rendered(_stored_view(state, started_at, updated_at, lease))


def rendered(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored view as the API shows it: each step's result, kept as JSON text, as the object it is."""
    steps = [
        {**step, "result": None if step["result"] is None else json.loads(step["result"])}
        for step in stored["steps"]
    ]
    return {**stored, "steps": steps}


def _stored_view(
    state: SagaState, started_at: str | None, updated_at: str | None, lease: LeaseTimes
) -> dict[str, Any]:
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
                "compensation_failures": step.compensation_failures, "route": step.route,
                "reservation_id": step.reservation_id,
            }
            for step in state.steps
        ],
        "version": state.version,
        "started_at": started_at,
        "updated_at": updated_at,
        "lease_ms": state.lease_ms,
        "lease_expires_at": lease.expires_at,
        "lease_lapsed_at": lease.lapsed_at,
    }  # fmt: skip


def row_view(row: SagaRow) -> dict[str, Any]:
    lease = LeaseTimes(_text(row.state.lease_expires_at), _text(row.lease_lapsed_at))
    return saga_view(row.state, _text(row.started_at), _text(row.updated_at), lease)


def _lease_after(row: SagaRow, new_state: SagaState, events: list[Any], ts: datetime | None) -> LeaseTimes:
    """The lease's instants once ``events`` are appended at ``ts`` (the deadline stamped as the append
    stamps it: ``ts`` plus the lease, while the saga is unfinished); with ``ts`` None, the lapse the head
    already records (the deadline is then the append's to write)."""
    lapsed_at = _text(row.lease_lapsed_at) if new_state.lease_lapsed else None
    if ts is None:
        return LeaseTimes(None, lapsed_at)
    if any(isinstance(event, SagaLeaseExpired) for event in events):
        lapsed_at = _text(ts)
    unfinished = new_state.status in ("running", "compensating") and new_state.lease_ms is not None
    expires = ts + timedelta(milliseconds=new_state.lease_ms or 0) if unfinished else None
    return LeaseTimes(_text(expires), lapsed_at)


def _text(instant: datetime | None) -> str | None:
    return None if instant is None else format_timestamp(instant)


class SagaService:
    """The saga use case over a ``SagaStore`` (``service/ports.py``), every round trip through ``guard``."""

    def __init__(self, store: SagaStore, guard: DatabaseGuard, *, conflict_retries: int = 16) -> None:
        self._store = store
        self._guard = guard
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
        idempotency = Idempotency(ctx.principal, ctx.idempotency_key, fingerprint(name, stream, fields))
        metadata = _metadata(name, command.saga_id, ctx)
        for _ in range(self._retries + 1):
            loaded = await self._guard.run(
                partial(self._store.load, command.saga_id, ctx.principal, ctx.idempotency_key)
            )
            row = loaded.row
            if row.state.status is not None and allowed is not None:
                allowed(row.state)
            if loaded.stored is not None:
                view = rendered(json.loads(replay(loaded.stored, idempotency.fingerprint)))
                return SagaResult(view, created=isinstance(command, StartSaga), replayed=True)
            events = decide(row.state, command)
            if not events:
                return SagaResult(row_view(row))
            new_state = fold(row.state, events)
            started_at = _text(row.started_at)
            response = _stored_view(new_state, started_at, None, _lease_after(row, new_state, events, None))
            plan = SagaPlan(row.state.version, events, new_state, metadata, idempotency, response)
            try:
                ts = await self._guard.run(partial(self._store.commit, plan))
            except StreamTaken as error:
                raise Conflict(f"the stream {stream} is taken by a lock, not a saga") from error
            except CommitConflict:
                continue  # the key was taken by a concurrent request: the next load finds its answer
            if ts is None:
                continue  # the saga moved on: decide again on what it is now
            stamp = format_timestamp(ts)
            view = saga_view(new_state, started_at or stamp, stamp, _lease_after(row, new_state, events, ts))
            return SagaResult(view, created=isinstance(command, StartSaga), changed=True)
        raise Unavailable(f"saga {command.saga_id} is too contended to decide now; retry", retry_after_s=1)


def _describe(command: SagaCommand) -> tuple[str, dict[str, Any]]:
    """The transition's name and fields, for its fingerprint and its events' metadata."""
    if isinstance(command, StartSaga):
        steps = [step_fields(step) for step in command.steps]
        return "saga-start", {
            "name": command.name, "owner": command.owner, "policy": command.policy, "steps": steps,
            "lease_ms": command.lease_ms,
        }  # fmt: skip
    if isinstance(command, RenewSagaLease):
        return "saga-heartbeat", {}
    if isinstance(command, ExpireSagaLease):
        return "saga-lease-expire", {"now": format_timestamp(command.now)}
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
