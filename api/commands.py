"""Command endpoints: acquire, renew (heartbeat), release, hand-off (and its accept or decline),
force-release.

With authentication on, the lease owner is the caller's principal: the body's ``owner`` may be left out,
and if given must be the principal's name (403 otherwise). In dev mode the body names the owner.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel

from api.command_route import LOCK_COMMAND_HEADERS, CommandCall, CommandCaller, CommandRoute
from api.dependencies import ResourcePath
from api.models import (
    AcceptRequest,
    AcquireRequest,
    DeclineRequest,
    ForceReleased,
    ForceReleaseRequest,
    HandedOff,
    HandOffRequest,
    Lease,
    Problem,
    Released,
    ReleaseRequest,
    RenewRequest,
)
from domain.access import Action, Principal
from domain.commands import Accept, Acquire, Command, Decline, ForceRelease, HandOff, Release, Renew
from domain.errors import NotOwner
from service.errors import Forbidden

router = APIRouter(prefix="/v1/locks", tags=["commands"], route_class=CommandRoute)

Holder = Annotated[CommandCall, Depends(CommandCaller(Action.HOLD, LOCK_COMMAND_HEADERS))]
Admin = Annotated[CommandCall, Depends(CommandCaller(Action.FORCE_RELEASE, LOCK_COMMAND_HEADERS))]


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": Problem, "content": {"application/problem+json": {}}} for status in statuses}


def lease_owner(claimed: str | None, caller: Principal) -> str:
    """The lease owner a command acts as: the principal, or in dev mode whoever the body names."""
    if not caller.authenticated:
        if claimed is None:
            raise RequestValidationError(
                [
                    {
                        "loc": ("body", "owner"),
                        "msg": "Field required without authentication",
                        "type": "missing",
                    }
                ]
            )
        return claimed
    if claimed is not None and claimed != caller.name:
        raise Forbidden(f"authenticated as {caller.name}; a command cannot act as {claimed}")
    return caller.name


class Executed(Protocol):
    """What a use case's ``execute`` returns: the outcome, and whether a stored one was replayed."""

    @property
    def outcome(self) -> object: ...

    @property
    def replayed(self) -> bool: ...


async def render_outcome(
    executing: Awaitable[Executed], call: CommandCall, model: type[BaseModel], status_code: int = 200
) -> Response:
    """Await a command's execution and render its outcome through ``model``, the response model the route
    documents; a replayed Idempotency-Key is rendered from the stored outcome, so byte for byte alike."""
    try:
        result = await executing
    except NotOwner as error:
        if call.caller.authenticated:
            raise Forbidden(f"the lease on {error.resource} belongs to {error.holder}") from error
        raise
    body = model.model_validate(result.outcome, from_attributes=True).model_dump_json()
    headers = {"Idempotent-Replayed": "true"} if result.replayed else None
    return Response(body, status_code=status_code, media_type="application/json", headers=headers)


async def _run(
    command: Command, call: CommandCall, model: type[BaseModel], status_code: int = 200
) -> Response:
    executing = call.service.execute(command, call.context, call.disconnected)
    return await render_outcome(executing, call, model, status_code)


@router.post("/{resource}/acquire", status_code=201, response_model=Lease, responses=problems(409, 422, 503))
async def acquire(resource: ResourcePath, body: AcquireRequest, call: Holder) -> Response:
    """Take the lock for `ttl_ms`, waiting up to `wait_ms` if it is held. 409 `lock_held` names the holder
    and its deadline."""
    ttl_ms = body.ttl_ms if body.ttl_ms is not None else call.service.default_ttl_ms
    command = Acquire(resource, lease_owner(body.owner, call.caller), ttl_ms, body.wait_ms)
    return await _run(command, call, Lease, status_code=201)


@router.post("/{resource}/renew", response_model=Lease, responses=problems(409, 410, 422, 503))
async def renew(resource: ResourcePath, body: RenewRequest, call: Holder) -> Response:
    """The heartbeat: extend the lease from now. 410 `lease_expired` once its deadline has passed;
    403 when the lease is another principal's."""
    command = Renew(resource, lease_owner(body.owner, call.caller), body.fencing_token, body.ttl_ms)
    return await _run(command, call, Lease)


@router.post("/{resource}/release", response_model=Released, responses=problems(409, 410, 422, 503))
async def release(resource: ResourcePath, body: ReleaseRequest, call: Holder) -> Response:
    """End the lease now so the next agent need not wait for the deadline; 403 when it is another's."""
    command = Release(resource, lease_owner(body.owner, call.caller), body.fencing_token)
    return await _run(command, call, Released)


@router.post("/{resource}/handoff", response_model=HandedOff, responses=problems(409, 410, 422, 503))
async def hand_off(resource: ResourcePath, body: HandOffRequest, call: Holder) -> Response:
    """Pass the live lease to the agent `to` in one step: it holds the lock at once with a new fencing
    token and must accept within `accept_within_ms`; the giver's token is refused from now on. 403 when
    the lease is another principal's (docs/decisions/0047-lease-hand-off.md)."""
    within = body.accept_within_ms if body.accept_within_ms is not None else call.service.default_ttl_ms
    owner = lease_owner(body.owner, call.caller)
    return await _run(HandOff(resource, owner, body.fencing_token, body.to, within), call, HandedOff)


@router.post("/{resource}/accept", response_model=Lease, responses=problems(409, 410, 422, 503))
async def accept(resource: ResourcePath, body: AcceptRequest, call: Holder) -> Response:
    """Take up the lease handed to the caller: renewed for `ttl_ms`, its fencing token returned. Once per
    hand-off; 409 `not_holder` when none awaits the caller, 410 `lease_expired` once its deadline passed."""
    ttl_ms = body.ttl_ms if body.ttl_ms is not None else call.service.default_ttl_ms
    return await _run(Accept(resource, lease_owner(body.owner, call.caller), ttl_ms), call, Lease)


@router.post("/{resource}/decline", response_model=Released, responses=problems(409, 410, 422, 503))
async def decline(resource: ResourcePath, body: DeclineRequest, call: Holder) -> Response:
    """Refuse the lease handed to the caller: it is released now. 409 `not_holder` when none awaits it."""
    return await _run(Decline(resource, lease_owner(body.owner, call.caller)), call, Released)


@router.post("/{resource}/force-release", response_model=ForceReleased, responses=problems(422, 503))
async def force_release(resource: ResourcePath, body: ForceReleaseRequest, call: Admin) -> Response:
    """Admin: end whatever lease is live, recording why. A free lock is left as it is (`released: false`)."""
    return await _run(ForceRelease(resource, body.reason), call, ForceReleased)
