"""Command endpoints: acquire, renew (heartbeat), release, force-release."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from api.dependencies import ResourcePath, command_context, lock_service
from api.models import (
    AcquireRequest,
    ForceReleased,
    ForceReleaseRequest,
    Lease,
    Problem,
    Released,
    ReleaseRequest,
    RenewRequest,
)
from domain.commands import Acquire, Command, ForceRelease, Release, Renew
from service.lock_service import CommandContext, LockService

router = APIRouter(prefix="/v1/locks", tags=["commands"])

Context = Annotated[CommandContext, Depends(command_context)]
Service = Annotated[LockService, Depends(lock_service)]


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": Problem, "content": {"application/problem+json": {}}} for status in statuses}


async def _run(service: LockService, command: Command, ctx: CommandContext) -> Response:
    result = await service.execute(command, ctx)
    headers = {"Idempotent-Replayed": "true"} if result.replayed else None
    return Response(
        result.body, status_code=result.status_code, media_type="application/json", headers=headers
    )


@router.post("/{resource}/acquire", status_code=201, response_model=Lease, responses=_problems(409, 422, 503))
async def acquire(
    resource: ResourcePath, body: AcquireRequest, request: Request, ctx: Context, service: Service
) -> Response:
    """Take the lock for `ttl_ms`. 409 `lock_held` names the holder and its deadline."""
    ttl_ms = body.ttl_ms if body.ttl_ms is not None else request.app.state.settings.ttl_default_ms
    return await _run(service, Acquire(resource, body.owner, ttl_ms), ctx)


@router.post("/{resource}/renew", response_model=Lease, responses=_problems(409, 410, 422, 503))
async def renew(resource: ResourcePath, body: RenewRequest, ctx: Context, service: Service) -> Response:
    """The heartbeat: extend the lease from now. 410 `lease_expired` once its deadline has passed."""
    return await _run(service, Renew(resource, body.owner, body.fencing_token, body.ttl_ms), ctx)


@router.post("/{resource}/release", response_model=Released, responses=_problems(409, 410, 422, 503))
async def release(resource: ResourcePath, body: ReleaseRequest, ctx: Context, service: Service) -> Response:
    """End the lease now so the next agent need not wait for the deadline."""
    return await _run(service, Release(resource, body.owner, body.fencing_token), ctx)


@router.post("/{resource}/force-release", response_model=ForceReleased, responses=_problems(422, 503))
async def force_release(
    resource: ResourcePath, body: ForceReleaseRequest, ctx: Context, service: Service
) -> Response:
    """Admin: end whatever lease is live, recording why. A free lock is left as it is (`released: false`)."""
    return await _run(service, ForceRelease(resource, body.reason), ctx)
