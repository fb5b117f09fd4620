"""Saga event payloads: the JSON body of each saga event in the log, and back.

One module for every saga payload, as ``domain/events.py`` is for lock payloads. A saga's stream is
``saga:<id>`` in the same events table (same append, same hash chain); the saga id lives in the stream id,
the event type in its own column. A step's ``result`` is kept as the JSON text the client sent, so any
JSON object can be stored (a NUL in a string, which jsonb cannot hold, stays escaped inside the text).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from domain.saga import (
    COMPENSATION_COMPLETED,
    COMPENSATION_FAILED,
    COMPENSATION_STARTED,
    SAGA_ABORT_REQUESTED,
    SAGA_ABORTED,
    SAGA_COMPLETED,
    SAGA_LEASE_EXPIRED,
    SAGA_LEASE_EXTENDED,
    SAGA_LEASE_RENEWED,
    SAGA_STARTED,
    SAGA_STUCK,
    STEP_COMPLETED,
    STEP_FAILED,
    STEP_STARTED,
    CompensationCompleted,
    CompensationFailed,
    CompensationStarted,
    SagaAborted,
    SagaAbortRequested,
    SagaCompleted,
    SagaEvent,
    SagaLeaseExpired,
    SagaLeaseExtended,
    SagaLeaseRenewed,
    SagaStarted,
    SagaStuck,
    StepCompleted,
    StepDef,
    StepFailed,
    StepStarted,
    step_fields,
)
from domain.timestamps import format_timestamp

SAGA_EVENT_TYPES = frozenset(
    {
        SAGA_STARTED, STEP_STARTED, STEP_COMPLETED, STEP_FAILED, SAGA_ABORT_REQUESTED, COMPENSATION_STARTED,
        COMPENSATION_COMPLETED, COMPENSATION_FAILED, SAGA_COMPLETED, SAGA_ABORTED, SAGA_STUCK,
        SAGA_LEASE_RENEWED, SAGA_LEASE_EXPIRED, SAGA_LEASE_EXTENDED,
    }
)  # fmt: skip


def saga_event_payload(event: SagaEvent) -> dict[str, Any]:
    """The JSON body stored in the log for ``event``."""
    if isinstance(event, SagaStarted):
        return {
            "name": event.name,
            "owner": event.owner,
            "policy": event.policy,
            "steps": [step_fields(step) for step in event.steps],
            "lease_ms": event.lease_ms,
        }
    if isinstance(event, SagaLeaseExpired):
        return {"deadline": format_timestamp(event.deadline), "lapses": event.lapses}
    if isinstance(event, StepCompleted):
        return {"step": event.step, "result": event.result}
    if isinstance(event, StepFailed):
        return {"step": event.step, "reason": event.reason}
    if isinstance(event, SagaAbortRequested):
        return {"reason": event.reason, "by": event.by}
    if isinstance(event, CompensationFailed):
        return {"step": event.step, "reason": event.reason, "failures": event.failures}
    if isinstance(event, SagaStuck):
        return {"step": event.step, "reason": event.reason}
    if isinstance(event, SagaAborted):
        return {"reason": event.reason}
    if isinstance(event, SagaCompleted | SagaLeaseRenewed | SagaLeaseExtended):
        return {}
    if isinstance(event, StepStarted) and event.reservation_id is not None:
        return {"step": event.step, "reservation_id": event.reservation_id}
    return {"step": event.step}  # STEP_STARTED, COMPENSATION_STARTED, COMPENSATION_COMPLETED


def saga_event_from_payload(event_type: str, data: dict[str, Any]) -> SagaEvent:
    """Inverse of :func:`saga_event_payload`, used by rebuild."""
    if event_type == SAGA_STARTED:
        steps = tuple(
            StepDef(str(s["name"]), tuple(str(r) for r in s["locks"]), bool(s.get("route", False)))
            for s in data["steps"]
        )
        lease_ms = data.get("lease_ms")  # absent from sagas started before leases
        return SagaStarted(
            str(data["name"]), str(data["owner"]), data["policy"], steps,
            None if lease_ms is None else int(lease_ms),
        )  # fmt: skip
    if event_type == STEP_STARTED:
        reservation_id = data.get("reservation_id")  # a route step's
        return StepStarted(str(data["step"]), None if reservation_id is None else str(reservation_id))
    if event_type == STEP_COMPLETED:
        return StepCompleted(str(data["step"]), data.get("result"))
    if event_type == STEP_FAILED:
        return StepFailed(str(data["step"]), str(data["reason"]))
    if event_type == SAGA_ABORT_REQUESTED:
        return SagaAbortRequested(str(data["reason"]), str(data.get("by", "")))
    if event_type == COMPENSATION_STARTED:
        return CompensationStarted(str(data["step"]))
    if event_type == COMPENSATION_COMPLETED:
        return CompensationCompleted(str(data["step"]))
    if event_type == COMPENSATION_FAILED:
        return CompensationFailed(str(data["step"]), str(data["reason"]), int(data["failures"]))
    if event_type == SAGA_COMPLETED:
        return SagaCompleted()
    if event_type == SAGA_ABORTED:
        return SagaAborted(data.get("reason"))
    if event_type == SAGA_STUCK:
        return SagaStuck(str(data["step"]), str(data["reason"]))
    if event_type == SAGA_LEASE_RENEWED:
        return SagaLeaseRenewed()
    if event_type == SAGA_LEASE_EXTENDED:
        return SagaLeaseExtended()
    if event_type == SAGA_LEASE_EXPIRED:
        return SagaLeaseExpired(datetime.fromisoformat(str(data["deadline"])), int(data["lapses"]))
    raise ValueError(f"unknown saga event type {event_type!r}")
