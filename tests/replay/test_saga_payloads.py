"""Every saga event survives the trip into the log and back: what rebuild folds and the timeline shows
is the event the decider made, the lease events included, and a saga started before leases (no
``lease_ms`` in its payload) reads back as a saga without a lease."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from domain.saga import (
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
)
from eventstore.saga_payloads import SAGA_EVENT_TYPES, saga_event_from_payload, saga_event_payload

EVERY_EVENT: list[SagaEvent] = [
    SagaStarted("move", "agv-1", "forward", (StepDef("pick", ("pallet:1",)),), 3000),
    SagaStarted("move", "agv-1", "compensate", (StepDef("drive", ("zone:1", "zone:2"), route=True),), 3000),
    StepStarted("pick"),
    StepStarted("drive", "6f1c0a52-0000-5000-8000-000000000000"),
    StepCompleted("pick", '{"from": "dock:3"}'),
    StepFailed("pick", "motor"),
    SagaAbortRequested("stop", "admin"),
    CompensationStarted("pick"),
    CompensationCompleted("pick"),
    CompensationFailed("pick", "arm", 2),
    SagaCompleted(),
    SagaAborted("stop"),
    SagaStuck("pick", "saga lease lapsed twice"),
    SagaLeaseRenewed(),
    SagaLeaseExpired(datetime(2026, 12, 4, 11, 0, 0, 123456, tzinfo=UTC), 1),
    SagaLeaseExtended(),
]


def test_every_saga_event_reads_back_as_written() -> None:
    assert {event.type for event in EVERY_EVENT} == SAGA_EVENT_TYPES
    for event in EVERY_EVENT:
        stored = json.loads(json.dumps(saga_event_payload(event)))  # as the jsonb column gives it back
        assert saga_event_from_payload(event.type, stored) == event


def test_a_lapse_names_the_deadline_that_passed_and_a_saga_from_before_leases_has_none() -> None:
    lapse = SagaLeaseExpired(datetime(2026, 12, 4, 11, 0, tzinfo=UTC), 2)
    assert saga_event_payload(lapse) == {"deadline": "2026-12-04T11:00:00.000000Z", "lapses": 2}
    old = {"name": "move", "owner": "agv-1", "policy": "compensate", "steps": [{"name": "a", "locks": []}]}
    started = saga_event_from_payload("SAGA_STARTED", old)
    assert isinstance(started, SagaStarted)
    assert started.lease_ms is None


def test_a_definition_without_route_steps_is_stored_as_before_them() -> None:
    """A start's payload (and fingerprint) names ``route`` only for a route step, so a saga started
    before route steps existed, retried with its Idempotency-Key, is the same request."""
    plain = SagaStarted("move", "agv-1", "compensate", (StepDef("pick", ("pallet:1",)),), 3000)
    assert saga_event_payload(plain)["steps"] == [{"name": "pick", "locks": ["pallet:1"]}]
    assert saga_event_payload(StepStarted("pick")) == {"step": "pick"}
