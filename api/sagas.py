"""Saga endpoints: start a saga, drive its steps and their compensations, complete or abort it, read it.

An agent drives its own sagas (the owner is its principal; another's is 403), dashboards and
investigators read them, an admin reads and may abort any. A transition the saga's state does not allow
is 409 ``saga_conflict``, naming the saga's status and the step it expects; a transition that already
happened answers 200 with the saga as it is, and appends nothing. The orchestrator heartbeats its saga's
lease (``POST /v1/sagas/{id}/heartbeat``); the reaper lapses the lease of a saga whose heartbeats stopped
(``service/saga_lapse.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import to_json

from api.auth import authenticate
from api.command_route import CommandCall, CommandCaller, CommandRoute
from api.commands import lease_owner
from api.models import Problem
from api.problems import problem
from api.request_checks import StrictRoute
from api.saga_models import (
    CompleteStepRequest,
    CreateSagaRequest,
    ReasonRequest,
    Saga,
    SagaDetail,
    SagaList,
    SagaName,
    SagaStatus,
)
from domain.access import Action, Principal, Role, allows, roles_allowed
from domain.errors import InvalidCommand
from domain.resource import OWNER_PATTERN
from domain.saga import (
    MAX_RESULT_BYTES,
    SAGA_ID_MAX_LENGTH,
    SAGA_ID_PATTERN,
    AbortSaga,
    CompleteCompensation,
    CompleteSaga,
    CompleteStep,
    FailCompensation,
    FailStep,
    RenewSagaLease,
    SagaCommand,
    SagaConflict,
    SagaDefinitionConflict,
    SagaNotFound,
    SagaState,
    StartCompensation,
    StartSaga,
    StartStep,
    StepDef,
    stream_id,
)
from projections import saga_state
from service.composition import saga_service_on_pool
from service.errors import Conflict, Forbidden
from service.saga_service import SagaContext, SagaService, row_view

# The transitions are commands, served as the lock commands are (api/command_route.py); the reads are not.
commands = APIRouter(prefix="/v1/sagas", tags=["sagas"], route_class=CommandRoute)
router = APIRouter(prefix="/v1/sagas", tags=["sagas"], route_class=StrictRoute)

SagaPath = Annotated[
    str,
    Path(min_length=1, max_length=SAGA_ID_MAX_LENGTH, pattern=SAGA_ID_PATTERN, description="The saga id."),
]
StepPath = Annotated[
    str,
    Path(min_length=1, max_length=SAGA_ID_MAX_LENGTH, pattern=SAGA_ID_PATTERN, description="A step's name."),
]


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": Problem, "content": {"application/problem+json": {}}} for status in statuses}


async def _caller(request: Request) -> Principal:
    """Any authenticated caller; each endpoint checks what its role and the saga's owner allow."""
    return await authenticate(request)


Caller = Annotated[Principal, Depends(_caller)]


Driver = Annotated[CommandCall, Depends(CommandCaller(Action.DRIVE_SAGA))]


def _context(call: CommandCall) -> SagaContext:
    context = call.context
    return SagaContext(
        context.principal, context.idempotency_key, context.correlation_id, context.causation_id
    )


def _role_refusal(caller: Principal, action: Action) -> str:
    needed = ", ".join(roles_allowed(action))
    return f"{caller.name} has role {caller.role}; {action} needs one of: {needed}"


def _reads_all(caller: Principal) -> bool:
    return not caller.authenticated or allows(caller.role, Action.READ_SAGAS)


def _own_only(caller: Principal) -> Callable[[SagaState], None]:
    """The check a transition makes of the saga it loaded: an agent drives its own sagas only."""

    def check(state: SagaState) -> None:
        if caller.authenticated and caller.role is not Role.ADMIN and state.owner != caller.name:
            raise Forbidden(f"saga {state.saga_id} belongs to {state.owner}")

    return check


def _service(request: Request) -> SagaService:
    """The app's saga service, made on first use on the lock service's pool and database guard."""
    state = request.app.state
    service: SagaService | None = getattr(state, "saga_service", None)
    if service is None:
        settings = state.settings
        service = saga_service_on_pool(
            state.pool,
            state.lock_service.guard,
            acquire_timeout_s=settings.pool_acquire_timeout_s,
            conflict_retries=settings.conflict_retries,
        )
        state.saga_service = service
    return service


async def _run(request: Request, command: SagaCommand, call: CommandCall) -> Response:
    service = _service(request)
    try:
        result = await service.execute(command, _context(call), _own_only(call.caller))
    except SagaConflict as error:
        return problem(
            409, error.code, error.detail, instance=request.url.path,
            saga_id=error.saga_id, saga_status=error.status, expected_step=error.expected_step,
        )  # fmt: skip
    except SagaNotFound as error:
        return problem(404, "not_found", error.detail, instance=request.url.path, saga_id=error.saga_id)
    except SagaDefinitionConflict as error:
        return problem(409, "conflict", error.detail, instance=request.url.path, saga_id=error.saga_id)
    body = Saga.model_validate(result.view).model_dump_json()
    headers = {"Idempotent-Replayed": "true"} if result.replayed else None
    status = 201 if result.created else 200
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _document(model: type[BaseModel], *statuses: int) -> dict[str, Any]:
    return {"response_model": model, "responses": _problems(*statuses)}


_SAGA_IDS = uuid.UUID("5b0c6f1e-2f7a-4c55-9a53-6a1d3c1f7e42")  # the namespace of ids made from keys


def _made_id(call: CommandCall) -> str:
    """A saga id for a create that names none: random, or, under an Idempotency-Key, derived from the
    caller and the key, so a retried create finds the saga (and the answer) the first one made."""
    context = call.context
    if context.idempotency_key is None:
        return str(uuid.uuid4())
    return str(uuid.uuid5(_SAGA_IDS, f"{context.principal}\n{context.idempotency_key}"))


@commands.post(
    "",
    response_model=Saga,
    status_code=201,
    responses={
        **_problems(409),
        200: {"model": Saga, "description": "The saga exists with this definition: as it is."},
    },
)
async def create_saga(request: Request, body: CreateSagaRequest, call: Driver) -> Response:
    """Start a saga (201). The same `saga_id` again with the same definition: 200 and the saga as it is;
    with another definition, or with step names that repeat: 409 `conflict`."""
    owner = lease_owner(body.owner, call.caller)
    saga_id = body.saga_id or _made_id(call)
    bounds = request.app.state.settings.ttl_bounds
    lease_ms = bounds.default_ms if body.lease_ms is None else body.lease_ms
    if not bounds.contains(lease_ms):  # outside the schema: 422 before any other check
        detail = f"lease_ms must be between {bounds.min_ms} and {bounds.max_ms}, got {lease_ms}"
        raise InvalidCommand(stream_id(saga_id), detail)
    names = [step.name for step in body.steps]
    if len(set(names)) != len(names):
        raise Conflict("step names must be unique within a saga")
    steps = tuple(StepDef(step.name, tuple(step.locks), step.route) for step in body.steps)
    start = StartSaga(saga_id, body.name, owner, steps, body.policy, lease_ms)
    return await _run(request, start, call)


@commands.post("/{saga_id}/heartbeat", **_document(Saga, 404, 409))
async def heartbeat(request: Request, saga_id: SagaPath, call: Driver) -> Response:
    """The orchestrator is alive: the saga's lease starts again (`lease_expires_at`), and a recorded lapse
    is cleared. Send it every third of the lease while the saga runs (the SDK does). An ended saga: 409
    `saga_conflict`."""
    return await _run(request, RenewSagaLease(saga_id), call)


@commands.post("/{saga_id}/steps/{step}/start", **_document(Saga, 404, 409))
async def start_step(request: Request, saga_id: SagaPath, step: StepPath, call: Driver) -> Response:
    """Start the next step (steps run in order, none after a failure or an abort)."""
    return await _run(request, StartStep(saga_id, step), call)


@commands.post("/{saga_id}/steps/{step}/complete", **_document(Saga, 404, 409))
async def complete_step(
    request: Request,
    saga_id: SagaPath,
    step: StepPath,
    call: Driver,
    body: Annotated[CompleteStepRequest | None, Body()] = None,
) -> Response:
    """The running step is done; `result` is kept and handed to its compensation later."""
    result = None
    if body is not None and body.result is not None:
        result = to_json(body.result).decode()  # compact JSON text, as stored
        if len(result.encode()) > MAX_RESULT_BYTES:
            return problem(
                422, "validation_error", f"result: at most {MAX_RESULT_BYTES} bytes of JSON",
                instance=request.url.path,
                errors=[{"loc": ["body", "result"], "msg": "too large", "type": "too_long"}],
            )  # fmt: skip
    return await _run(request, CompleteStep(saga_id, step, result), call)


@commands.post("/{saga_id}/steps/{step}/fail", **_document(Saga, 404, 409))
async def fail_step(
    request: Request, saga_id: SagaPath, step: StepPath, body: ReasonRequest, call: Driver
) -> Response:
    """The running step failed: the saga starts compensating its completed steps, last first."""
    return await _run(request, FailStep(saga_id, step, body.reason), call)


@commands.post("/{saga_id}/steps/{step}/compensation/start", **_document(Saga, 404, 409))
async def start_compensation(request: Request, saga_id: SagaPath, step: StepPath, call: Driver) -> Response:
    """Start compensating the last completed step not yet compensated."""
    return await _run(request, StartCompensation(saga_id, step), call)


@commands.post("/{saga_id}/steps/{step}/compensation/complete", **_document(Saga, 404, 409))
async def complete_compensation(
    request: Request, saga_id: SagaPath, step: StepPath, call: Driver
) -> Response:
    """The step is compensated; once every completed step is, the saga is `aborted`."""
    return await _run(request, CompleteCompensation(saga_id, step), call)


@commands.post("/{saga_id}/steps/{step}/compensation/fail", **_document(Saga, 404, 409))
async def fail_compensation(
    request: Request, saga_id: SagaPath, step: StepPath, body: ReasonRequest, call: Driver
) -> Response:
    """The compensation failed; the orchestrator retries it. The fifth failure of one step's compensation
    makes the saga `stuck` with this reason. Each call counts one failure: retry with an Idempotency-Key."""
    return await _run(request, FailCompensation(saga_id, step, body.reason), call)


@commands.post("/{saga_id}/complete", **_document(Saga, 404, 409))
async def complete_saga(request: Request, saga_id: SagaPath, call: Driver) -> Response:
    """Every step completed: the saga is `completed`."""
    return await _run(request, CompleteSaga(saga_id), call)


@commands.post("/{saga_id}/abort", **_document(Saga, 404, 409))
async def abort_saga(request: Request, saga_id: SagaPath, body: ReasonRequest, call: Driver) -> Response:
    """The owner or an admin aborts a running saga: it compensates its completed steps, last first, and
    is then `aborted`."""
    return await _run(request, AbortSaga(saga_id, body.reason, call.caller.name), call)


def _reader(caller: Principal) -> Principal:
    """Dashboards, investigators and admins read every saga; an agent reads its own."""
    if not (_reads_all(caller) or allows(caller.role, Action.DRIVE_SAGA)):
        raise Forbidden(_role_refusal(caller, Action.READ_SAGAS))
    return caller


@router.get("", response_model=SagaList)
async def list_sagas(
    request: Request,
    caller: Caller,
    status: Annotated[SagaStatus | None, Query()] = None,
    owner: Annotated[str | None, Query(pattern=OWNER_PATTERN, max_length=200)] = None,
    name: Annotated[SagaName | None, Query()] = None,
    cursor: Annotated[str | None, Query(pattern=SAGA_ID_PATTERN, max_length=SAGA_ID_MAX_LENGTH)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> SagaList:
    """Sagas by id, filtered by status, owner or name; page with `cursor`. An agent sees its own."""
    _reader(caller)
    if not _reads_all(caller):
        if owner is not None and owner != caller.name:
            raise Forbidden(f"{caller.name} may list its own sagas only")
        owner = caller.name
    async with request.app.state.read_pool.acquire() as conn:
        page = await saga_state.list_sagas(
            conn, status=status, owner=owner, name=name, cursor=cursor, limit=limit
        )
    items = [Saga.model_validate(row_view(row)) for row in page.items]
    return SagaList(items=items, next_cursor=page.next_cursor)


@router.get("/{saga_id}", response_model=SagaDetail, responses=_problems(404))
async def get_saga(request: Request, saga_id: SagaPath, caller: Caller) -> SagaDetail:
    """The saga and its timeline: every event of its stream, in order."""
    _reader(caller)
    async with request.app.state.read_pool.acquire() as conn:
        row = await saga_state.get_saga(conn, saga_id)
        if row is None:
            raise HTTPException(404, f"no saga {saga_id}")
        if not _reads_all(caller) and row.state.owner != caller.name:
            raise Forbidden(f"saga {saga_id} belongs to {row.state.owner}")
        timeline = await saga_state.saga_timeline(conn, saga_id)
    view = row_view(row)
    view["timeline"] = [
        {
            "position": e.position,
            "version": e.version,
            "type": e.type,
            "data": e.data,
            "recorded_at": e.recorded_at,
        }
        for e in timeline
    ]
    return SagaDetail.model_validate(view)
