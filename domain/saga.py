"""The saga decider: ``decide(state, command) -> events`` and ``evolve(state, event) -> state``.

A saga is an ordered list of steps, each taking some locks. Steps run one after another; a failed step or
an abort stops the forward run, and every completed step is then compensated, last completed first. A
compensation that fails is retried by the orchestrator; the fifth failure of one step's compensation
leaves the saga ``stuck`` for an operator. ``completed``, ``aborted`` and ``stuck`` are final.

A saga holds a lease of its own (``lease_ms``), renewed by its orchestrator's heartbeats and by every
transition it records. When the lease lapses (the orchestrator crashed, lost its network, or could not
reach a service that was down), the reaper sends ``ExpireSagaLease``: at the first lapse a ``compensate``
saga fails its running step and compensates (or completes, or aborts, as its steps dictate), a
``forward`` saga stays running with the lapse recorded; a second lapse with no heartbeat in between
(nobody came back to finish it) makes the saga ``stuck`` with the reason. Like a lock grant's, the
deadline is stamped by the append from the database clock (``lease_expires_at`` is None in a state
folded here, and filled from the stream head where the saga is loaded). After an outage of the database
the lease starts again (``SAGA_LEASE_EXTENDED``, appended set-wise by ``service/outage.py`` as it extends
locks): no saga lapses because nobody could reach the service, and a recorded lapse stays recorded.

Repeating a transition that already happened (the same step, the same target) changes nothing: ``decide``
returns no events, so an orchestrator that resumes may redo its last call safely. Any other transition
the state does not allow raises :class:`SagaConflict`, which names the saga's status and the step it
expects next. Pure functions over plain data, like ``domain/decider.py``.

A *route* step takes its locks as one reservation (``domain/reservation.py``): all or none, one heartbeat
for the set. Its locks must then be distinct and at most a reservation's maximum; its reservation id is
made from the saga and the step (``route_reservation_id``), so any orchestrator, and the log, name the
same reservation; ``STEP_STARTED`` records it.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any, Literal

from domain.errors import DomainError, InvalidCommand
from domain.reservation import MAX_RESOURCES
from domain.value import value

# A saga id or step name is one URL path segment: the resource rule (not only dots, which a client would
# normalize away), at most 100 characters.
SAGA_ID_PATTERN = r"^[A-Za-z0-9._:\-]*[A-Za-z0-9_:\-][A-Za-z0-9._:\-]*$"
SAGA_ID_MAX_LENGTH = 100
MAX_STEPS = 32
MAX_LOCKS_PER_STEP = 16
MAX_RESULT_BYTES = 4096
MAX_COMPENSATION_FAILURES = 5  # the fifth failure of one step's compensation makes the saga stuck
MAX_LOCKS_PER_ROUTE = min(MAX_LOCKS_PER_STEP, MAX_RESOURCES)  # a route step's locks: one reservation
STREAM_PREFIX = "saga/"  # "/" is never in a lock resource: no lock can share a saga's stream

_ID_RE = re.compile(SAGA_ID_PATTERN)
_ROUTE_NAMESPACE = uuid.UUID("0f8e3c52-7a41-4d0b-b1f6-2a9d5c3e8b70")  # route reservation ids

SagaStatus = Literal["running", "compensating", "completed", "aborted", "stuck"]
StepStatus = Literal["pending", "running", "completed", "failed", "compensating", "compensated"]
Policy = Literal["compensate", "forward"]
TERMINAL: frozenset[str] = frozenset({"completed", "aborted", "stuck"})

SAGA_STARTED = "SAGA_STARTED"
STEP_STARTED = "STEP_STARTED"
STEP_COMPLETED = "STEP_COMPLETED"
STEP_FAILED = "STEP_FAILED"
SAGA_ABORT_REQUESTED = "SAGA_ABORT_REQUESTED"
COMPENSATION_STARTED = "COMPENSATION_STARTED"
COMPENSATION_COMPLETED = "COMPENSATION_COMPLETED"
COMPENSATION_FAILED = "COMPENSATION_FAILED"
SAGA_COMPLETED = "SAGA_COMPLETED"
SAGA_ABORTED = "SAGA_ABORTED"
SAGA_STUCK = "SAGA_STUCK"
SAGA_LEASE_RENEWED = "SAGA_LEASE_RENEWED"
SAGA_LEASE_EXPIRED = "SAGA_LEASE_EXPIRED"
SAGA_LEASE_EXTENDED = "SAGA_LEASE_EXTENDED"

LAPSE_REASON = "saga lease lapsed: the orchestrator stopped heartbeating"
STUCK_REASON = "saga lease lapsed twice: no orchestrator came back to finish it"


def is_valid_saga_id(text: str) -> bool:
    """A saga id or a step name: ``SAGA_ID_PATTERN``, 1-100 characters."""
    return len(text) <= SAGA_ID_MAX_LENGTH and _ID_RE.match(text) is not None


def stream_id(saga_id: str) -> str:
    """The saga's stream in the events table."""
    return STREAM_PREFIX + saga_id


def step_fields(step: StepDef) -> dict[str, Any]:
    """A step of a definition as plain fields (the log's payload, a start's fingerprint); ``route`` only
    when set, so a definition without route steps reads as it did before they existed."""
    return {"name": step.name, "locks": list(step.locks), **({"route": True} if step.route else {})}


def route_reservation_id(saga_id: str, step: str) -> str:
    """The reservation a route step takes its locks as: the same for the saga's every orchestrator, and
    distinct for every (saga, step) whatever characters they contain (a UUID fits the id's 100)."""
    return str(uuid.uuid5(_ROUTE_NAMESPACE, f"{saga_id}\n{step}"))


# --- state -------------------------------------------------------------------------------------------


@value
class StepDef:
    name: str
    locks: tuple[str, ...]
    route: bool = False  # the locks are taken as one reservation, all or none


@value
class StepState:
    name: str
    locks: tuple[str, ...]
    status: StepStatus = "pending"
    result: str | None = None  # what the step recorded, as JSON text (stored as given)
    error: str | None = None
    compensation_failures: int = 0
    route: bool = False
    reservation_id: str | None = None  # a route step's reservation (``route_reservation_id``)


@value
class SagaState:
    """A saga folded from its stream; ``version`` 0 and ``status`` None: never started."""

    saga_id: str
    version: int = 0
    name: str = ""
    owner: str = ""
    policy: Policy = "compensate"
    status: SagaStatus | None = None
    reason: str | None = None
    steps: tuple[StepState, ...] = ()
    lease_ms: int | None = None  # None: a saga without a lease (never lapses)
    lease_lapsed: bool = False  # the lease lapsed, and no heartbeat came since
    lease_expires_at: datetime | None = None  # stamped by the append; None until loaded from the head

    def step(self, name: str) -> StepState | None:
        return next((step for step in self.steps if step.name == name), None)

    def definition(self) -> tuple[str, str, Policy, tuple[StepDef, ...]]:
        return (
            self.name,
            self.owner,
            self.policy,
            tuple(StepDef(s.name, s.locks, s.route) for s in self.steps),
        )

    def expected_step(self) -> str | None:
        """The step the saga waits on: the running one, the next to start, or the next to compensate."""
        if self.status in TERMINAL or self.status is None:
            return None
        busy = [s.name for s in self.steps if s.status in ("running", "compensating")]
        if busy:
            return busy[0]
        if self.status == "running":
            return next((s.name for s in self.steps if s.status == "pending"), None)
        return next((s.name for s in reversed(self.steps) if s.status == "completed"), None)


def initial_saga(saga_id: str) -> SagaState:
    return SagaState(saga_id=saga_id)


# --- commands ----------------------------------------------------------------------------------------


@value
class StartSaga:
    saga_id: str
    name: str
    owner: str
    steps: tuple[StepDef, ...]
    policy: Policy = "compensate"
    lease_ms: int | None = None  # not part of the definition: a second start with another lease is the same


@value
class StartStep:
    saga_id: str
    step: str


@value
class CompleteStep:
    saga_id: str
    step: str
    result: str | None = None  # JSON text


@value
class FailStep:
    saga_id: str
    step: str
    reason: str


@value
class StartCompensation:
    saga_id: str
    step: str


@value
class CompleteCompensation:
    saga_id: str
    step: str


@value
class FailCompensation:
    saga_id: str
    step: str
    reason: str


@value
class CompleteSaga:
    saga_id: str


@value
class AbortSaga:
    saga_id: str
    reason: str
    by: str = ""


@value
class RenewSagaLease:
    """The orchestrator's heartbeat: it is alive, the lease starts again."""

    saga_id: str


@value
class ExpireSagaLease:
    """The reaper's: lapse the lease if its deadline has passed at ``now`` (the database clock)."""

    saga_id: str
    now: datetime


SagaCommand = (
    StartSaga | StartStep | CompleteStep | FailStep | StartCompensation | CompleteCompensation
    | FailCompensation | CompleteSaga | AbortSaga | RenewSagaLease | ExpireSagaLease
)  # fmt: skip


# --- events ------------------------------------------------------------------------------------------


@value
class SagaStarted:
    name: str
    owner: str
    policy: Policy
    steps: tuple[StepDef, ...]
    lease_ms: int | None = None
    type: str = SAGA_STARTED


@value
class StepStarted:
    step: str
    reservation_id: str | None = None  # a route step's: the reservation its locks are taken as
    type: str = STEP_STARTED


@value
class StepCompleted:
    step: str
    result: str | None
    type: str = STEP_COMPLETED


@value
class StepFailed:
    step: str
    reason: str
    type: str = STEP_FAILED


@value
class SagaAbortRequested:
    reason: str
    by: str
    type: str = SAGA_ABORT_REQUESTED


@value
class CompensationStarted:
    step: str
    type: str = COMPENSATION_STARTED


@value
class CompensationCompleted:
    step: str
    type: str = COMPENSATION_COMPLETED


@value
class CompensationFailed:
    step: str
    reason: str
    failures: int  # this step's compensation failures so far, this one included
    type: str = COMPENSATION_FAILED


@value
class SagaCompleted:
    type: str = SAGA_COMPLETED


@value
class SagaAborted:
    reason: str | None
    type: str = SAGA_ABORTED


@value
class SagaStuck:
    step: str
    reason: str
    type: str = SAGA_STUCK


@value
class SagaLeaseRenewed:
    type: str = SAGA_LEASE_RENEWED


@value
class SagaLeaseExpired:
    deadline: datetime  # the deadline that passed
    lapses: int  # 1 at the first lapse, 2 at the one that makes the saga stuck
    type: str = SAGA_LEASE_EXPIRED


@value
class SagaLeaseExtended:
    """The lease started again after an outage (no orchestrator could heartbeat); not a heartbeat."""

    type: str = SAGA_LEASE_EXTENDED


SagaEvent = (
    SagaStarted | StepStarted | StepCompleted | StepFailed | SagaAbortRequested | CompensationStarted
    | CompensationCompleted | CompensationFailed | SagaCompleted | SagaAborted | SagaStuck
    | SagaLeaseRenewed | SagaLeaseExpired | SagaLeaseExtended
)  # fmt: skip


# --- errors ------------------------------------------------------------------------------------------


class SagaConflict(DomainError):
    """A transition the saga's state does not allow (409 ``saga_conflict``)."""

    code = "saga_conflict"

    def __init__(self, state: SagaState, detail: str) -> None:
        super().__init__(stream_id(state.saga_id), detail)
        self.saga_id = state.saga_id
        self.status = state.status
        self.expected_step = state.expected_step()


class SagaNotFound(DomainError):
    code = "not_found"

    def __init__(self, saga_id: str) -> None:
        super().__init__(stream_id(saga_id), f"no saga {saga_id}")
        self.saga_id = saga_id


class SagaDefinitionConflict(DomainError):
    """The saga id is taken by a saga with another definition (409 ``conflict``)."""

    code = "conflict"

    def __init__(self, saga_id: str) -> None:
        super().__init__(stream_id(saga_id), f"saga {saga_id} exists with another definition")
        self.saga_id = saga_id


# --- decide ------------------------------------------------------------------------------------------


def decide(state: SagaState, command: SagaCommand) -> list[SagaEvent]:
    """The events ``command`` causes on a saga in ``state``; none for a transition that already happened.

    Raises :class:`SagaNotFound` for a saga never started, :class:`SagaDefinitionConflict` for a second
    start with another definition, :class:`SagaConflict` for a transition the state does not allow.
    """
    if isinstance(command, StartSaga):
        return _start(state, command)
    if state.status is None:
        raise SagaNotFound(state.saga_id)
    if isinstance(command, CompleteSaga):
        return _complete_saga(state)
    if isinstance(command, AbortSaga):
        return _abort(state, command)
    if isinstance(command, RenewSagaLease):
        return _renew_lease(state)
    if isinstance(command, ExpireSagaLease):
        return _expire_lease(state, command.now)
    step = state.step(command.step)
    if step is None:
        raise SagaConflict(state, f"saga {state.saga_id} has no step {command.step}")
    if isinstance(command, StartStep):
        return _start_step(state, step)
    if isinstance(command, CompleteStep):
        return _complete_step(state, step, command.result)
    if isinstance(command, FailStep):
        return _fail_step(state, step, command.reason)
    if isinstance(command, StartCompensation):
        return _start_compensation(state, step)
    if isinstance(command, CompleteCompensation):
        return _complete_compensation(state, step)
    assert isinstance(command, FailCompensation)
    return _fail_compensation(state, step, command.reason)


def _refuse(state: SagaState, what: str) -> SagaConflict:
    expected = state.expected_step()
    wants = f"; it expects step {expected}" if expected is not None else ""
    return SagaConflict(state, f"saga {state.saga_id} is {state.status}: cannot {what}{wants}")


def _start(state: SagaState, command: StartSaga) -> list[SagaEvent]:
    _validate_definition(command)
    if state.status is not None:
        if state.definition() == (command.name, command.owner, command.policy, command.steps):
            return []
        raise SagaDefinitionConflict(state.saga_id)
    return [SagaStarted(command.name, command.owner, command.policy, command.steps, command.lease_ms)]


def _validate_definition(command: StartSaga) -> None:
    problems = []
    if not is_valid_saga_id(command.saga_id):
        problems.append("saga_id must be 1-100 characters of [A-Za-z0-9._:-], not only dots")
    if not 1 <= len(command.steps) <= MAX_STEPS:
        problems.append(f"a saga has 1-{MAX_STEPS} steps")
    names = [step.name for step in command.steps]
    if len(set(names)) != len(names):
        problems.append("step names must be unique")
    if any(not is_valid_saga_id(name) for name in names):
        problems.append("a step name is 1-100 characters of [A-Za-z0-9._:-], not only dots")
    if any(len(step.locks) > MAX_LOCKS_PER_STEP for step in command.steps):
        problems.append(f"a step takes at most {MAX_LOCKS_PER_STEP} locks")
    routes = [step for step in command.steps if step.route]
    if any(not 1 <= len(step.locks) <= MAX_LOCKS_PER_ROUTE for step in routes):
        problems.append(f"a route step takes 1-{MAX_LOCKS_PER_ROUTE} locks")
    if any(len(set(step.locks)) != len(step.locks) for step in routes):
        problems.append("a route step names each lock once")
    if command.lease_ms is not None and command.lease_ms <= 0:
        problems.append("lease_ms is a positive number of milliseconds")
    if problems:
        raise InvalidCommand(stream_id(command.saga_id), "; ".join(problems))


def _start_step(state: SagaState, step: StepState) -> list[SagaEvent]:
    if step.status == "running":
        return []
    if state.status != "running" or step.name != state.expected_step() or step.status != "pending":
        raise _refuse(state, f"start step {step.name}")
    return [StepStarted(step.name, step.reservation_id)]


def _complete_step(state: SagaState, step: StepState, result: str | None) -> list[SagaEvent]:
    if step.status == "completed" and step.result == result:
        return []
    if step.status != "running" or state.status in TERMINAL:
        raise _refuse(state, f"complete step {step.name}")
    # A step still running when the saga was aborted may finish; it is then compensated like the others.
    return [StepCompleted(step.name, result)]


def _fail_step(state: SagaState, step: StepState, reason: str) -> list[SagaEvent]:
    if step.status == "failed" and step.error == reason:
        return []
    if step.status != "running" or state.status in TERMINAL:
        raise _refuse(state, f"fail step {step.name}")
    event = StepFailed(step.name, reason)
    return [event, *_aborted_if_done(evolve(state, event))]


def _abort(state: SagaState, command: AbortSaga) -> list[SagaEvent]:
    if state.status in ("compensating", "aborted"):
        return []  # already aborting or aborted: the abort happened
    if state.status != "running":
        raise _refuse(state, "abort")
    event = SagaAbortRequested(command.reason, command.by)
    return [event, *_aborted_if_done(evolve(state, event))]


def _start_compensation(state: SagaState, step: StepState) -> list[SagaEvent]:
    if step.status == "compensating":
        return []
    if state.status != "compensating" or step.status != "completed" or step.name != state.expected_step():
        raise _refuse(state, f"start compensating step {step.name}")
    return [CompensationStarted(step.name)]


def _complete_compensation(state: SagaState, step: StepState) -> list[SagaEvent]:
    if step.status == "compensated":
        return []
    if state.status != "compensating" or step.status != "compensating":
        raise _refuse(state, f"complete the compensation of step {step.name}")
    event = CompensationCompleted(step.name)
    return [event, *_aborted_if_done(evolve(state, event))]


def _fail_compensation(state: SagaState, step: StepState, reason: str) -> list[SagaEvent]:
    if state.status == "stuck" and step.compensation_failures >= MAX_COMPENSATION_FAILURES:
        return []  # the failure that made it stuck, repeated
    if state.status != "compensating" or step.status != "compensating":
        raise _refuse(state, f"fail the compensation of step {step.name}")
    failures = step.compensation_failures + 1
    events: list[SagaEvent] = [CompensationFailed(step.name, reason, failures)]
    if failures >= MAX_COMPENSATION_FAILURES:
        events.append(SagaStuck(step.name, reason))
    return events


def _complete_saga(state: SagaState) -> list[SagaEvent]:
    if state.status == "completed":
        return []
    if state.status != "running" or any(step.status != "completed" for step in state.steps):
        raise _refuse(state, "complete")
    return [SagaCompleted()]


def _renew_lease(state: SagaState) -> list[SagaEvent]:
    if state.status in TERMINAL:
        raise _refuse(state, "renew its lease")
    return [SagaLeaseRenewed()]


def _expire_lease(state: SagaState, now: datetime) -> list[SagaEvent]:
    """Nothing while the lease is live (or the saga has none, or has ended). At the first lapse the
    orchestrator is presumed lost: a ``compensate`` saga's running step fails (its action may have
    half-run) and the saga compensates; one with nothing to undo ends at once; a saga whose steps all
    completed is completed. A ``forward`` saga only records the lapse (its steps must run again, which
    only an orchestrator can do). A second lapse in a row makes the saga stuck."""
    deadline = state.lease_expires_at
    if state.status in TERMINAL or deadline is None or now < deadline:
        return []
    if state.lease_lapsed:
        lapse = SagaLeaseExpired(deadline, 2)
        return [lapse, SagaStuck(state.expected_step() or "", STUCK_REASON)]
    lapse = SagaLeaseExpired(deadline, 1)
    lapsed = evolve(state, lapse)
    running = next((step for step in lapsed.steps if step.status == "running"), None)
    if lapsed.status == "running" and all(step.status == "completed" for step in lapsed.steps):
        return [lapse, SagaCompleted()]
    if lapsed.status == "running" and lapsed.policy == "forward":
        return [lapse]
    if running is not None:
        return [lapse, *_fail_step(lapsed, running, LAPSE_REASON)]
    if lapsed.status == "running":
        abort = SagaAbortRequested(LAPSE_REASON, "reaper")
        return [lapse, abort, *_aborted_if_done(evolve(lapsed, abort))]
    return [lapse]  # compensating, a compensation under way: only an orchestrator can finish it


def _aborted_if_done(state: SagaState) -> list[SagaEvent]:
    """``SAGA_ABORTED`` once a compensating saga has nothing left running and nothing to compensate."""
    if state.status != "compensating":
        return []
    if any(step.status in ("running", "compensating", "completed") for step in state.steps):
        return []
    return [SagaAborted(state.reason)]


# --- evolve ------------------------------------------------------------------------------------------


def evolve(state: SagaState, event: SagaEvent) -> SagaState:
    """The saga after ``event``."""
    version = state.version + 1
    if isinstance(event, SagaStarted):
        steps = tuple(
            StepState(step.name, step.locks, route=step.route, reservation_id=_reservation(state, step))
            for step in event.steps
        )
        return SagaState(
            state.saga_id, version, event.name, event.owner, event.policy, "running", None, steps,
            event.lease_ms,
        )  # fmt: skip
    if isinstance(event, SagaLeaseRenewed):
        return _with(state, version=version, lease_lapsed=False)
    if isinstance(event, SagaLeaseExpired):
        return _with(state, version=version, lease_lapsed=True)
    if isinstance(event, SagaLeaseExtended):
        return _with(state, version=version)
    if isinstance(event, StepStarted):
        return _with_step(state, version, event.step, status="running")
    if isinstance(event, StepCompleted):
        return _with_step(state, version, event.step, status="completed", result=event.result)
    if isinstance(event, StepFailed):
        failed = _with_step(state, version, event.step, status="failed", error=event.reason)
        return _with(failed, status="compensating", reason=event.reason)
    if isinstance(event, SagaAbortRequested):
        return _with(state, version=version, status="compensating", reason=event.reason)
    if isinstance(event, CompensationStarted):
        return _with_step(state, version, event.step, status="compensating")
    if isinstance(event, CompensationCompleted):
        return _with_step(state, version, event.step, status="compensated")
    if isinstance(event, CompensationFailed):
        return _with_step(
            state, version, event.step, error=event.reason, compensation_failures=event.failures
        )
    if isinstance(event, SagaCompleted):
        return _with(state, version=version, status="completed")
    if isinstance(event, SagaAborted):
        return _with(state, version=version, status="aborted")
    assert isinstance(event, SagaStuck)
    return _with(state, version=version, status="stuck", reason=event.reason)


def _reservation(state: SagaState, step: StepDef) -> str | None:
    return route_reservation_id(state.saga_id, step.name) if step.route else None


def fold(state: SagaState, events: list[SagaEvent]) -> SagaState:
    for event in events:
        state = evolve(state, event)
    return state


def _with(
    state: SagaState,
    *,
    version: int | None = None,
    status: SagaStatus | None = None,
    reason: str | None = None,
    steps: tuple[StepState, ...] | None = None,
    lease_lapsed: bool | None = None,
) -> SagaState:
    """A changed copy; the lease deadline is left out: the next append stamps it."""
    return SagaState(
        state.saga_id,
        state.version if version is None else version,
        state.name,
        state.owner,
        state.policy,
        state.status if status is None else status,
        state.reason if reason is None else reason,
        state.steps if steps is None else steps,
        state.lease_ms,
        state.lease_lapsed if lease_lapsed is None else lease_lapsed,
    )


def _with_step(
    state: SagaState,
    version: int,
    name: str,
    *,
    status: StepStatus | None = None,
    result: str | None = None,
    error: str | None = None,
    compensation_failures: int | None = None,
) -> SagaState:
    steps = tuple(
        StepState(
            step.name,
            step.locks,
            step.status if status is None else status,
            step.result if result is None else result,
            step.error if error is None else error,
            step.compensation_failures if compensation_failures is None else compensation_failures,
            step.route,
            step.reservation_id,
        )
        if step.name == name
        else step
        for step in state.steps
    )
    return _with(state, version=version, steps=steps)
