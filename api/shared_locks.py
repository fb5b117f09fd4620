"""Shared locks and semaphores (``domain/shared_lock.py``, docs/decisions/0051-shared-locks.md).

The same roles, headers, owner rule, Idempotency-Key handling and problems as the lock commands
(``api/commands.py``); a ``lock_held`` refusal names every conflicting grant in ``conflicts`` (mode,
owner, token, deadline), and ``limit_mismatch`` the limit the live grants agreed on. A shared lock is a
lock of its own: the mutex ``/v1/locks/{resource}`` of the same name is another lock.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from api.auth import require
from api.command_route import CommandCall, CommandRoute
from api.commands import Holder, lease_owner, problems, render_outcome
from api.dependencies import ResourcePath
from api.models import History
from api.queries import Window, stream_history
from api.replay import ARCHIVED
from api.request_checks import StrictRoute
from api.shared_lock_models import (
    ListedSharedGrant,
    SharedAcquireRequest,
    SharedGrant,
    SharedGrantList,
    SharedHolder,
    SharedLockInfo,
    SharedReleased,
    SharedReleaseRequest,
    SharedRenewRequest,
    SharedWaiter,
)
from domain.access import Action
from domain.resource import OWNER_PATTERN
from domain.shared_lock import AcquireShared, Mode, ReleaseShared, RenewShared, SharedCommand, stream_id
from projections.shared_locks import Holder as GrantRow
from projections.shared_locks import ListedGrant, holders_of, list_grants
from service.queue_store import Waiting, queue_of
from service.shared_lock_service import SharedLockService

commands = APIRouter(prefix="/v1/shared-locks", tags=["shared locks"], route_class=CommandRoute)
router = APIRouter(prefix="/v1/shared-locks", tags=["shared locks"], route_class=StrictRoute)


def _service(request: Request) -> SharedLockService:
    service: SharedLockService = request.app.state.shared_lock_service
    return service


async def _run(
    command: SharedCommand,
    call: CommandCall,
    request: Request,
    model: type[BaseModel],
    status_code: int = 200,
) -> Response:
    executing = _service(request).execute(command, call.context, call.disconnected)
    return await render_outcome(executing, call, model, status_code)


@commands.post(
    "/{resource}/acquire", status_code=201, response_model=SharedGrant, responses=problems(409, 422, 503)
)
async def acquire(
    resource: ResourcePath, body: SharedAcquireRequest, call: Holder, request: Request
) -> Response:
    """Take a grant in `mode` for `ttl_ms` (under `limit`, for a semaphore), waiting up to `wait_ms` for a
    place. 409 `lock_held` names the conflicting grants (`conflicts`); 409 `limit_mismatch` when live
    grants agreed on another limit."""
    ttl_ms = body.ttl_ms if body.ttl_ms is not None else _service(request).default_ttl_ms
    owner = lease_owner(body.owner, call.caller)
    command = AcquireShared(resource, owner, body.mode, ttl_ms, body.limit, body.wait_ms)
    return await _run(command, call, request, SharedGrant, status_code=201)


@commands.post("/{resource}/renew", response_model=SharedGrant, responses=problems(409, 410, 422, 503))
async def renew(resource: ResourcePath, body: SharedRenewRequest, call: Holder, request: Request) -> Response:
    """The grant's heartbeat. 410 `lease_expired` once its deadline has passed, 409 `not_holder` once it
    ended (or never was); 403 when it is another principal's."""
    command = RenewShared(resource, lease_owner(body.owner, call.caller), body.fencing_token, body.ttl_ms)
    return await _run(command, call, request, SharedGrant)


@commands.post("/{resource}/release", response_model=SharedReleased, responses=problems(409, 410, 422, 503))
async def release(
    resource: ResourcePath, body: SharedReleaseRequest, call: Holder, request: Request
) -> Response:
    """End the grant now, so waiters need not wait for its deadline; 403 when it is another's."""
    command = ReleaseShared(resource, lease_owner(body.owner, call.caller), body.fencing_token)
    return await _run(command, call, request, SharedReleased)


# A page's cursor: the last grant listed, ``<resource>/<fencing_token>`` ("/" is never in a resource).
GRANT_CURSOR_PATTERN = r"^[A-Za-z0-9._:\-]{1,200}/\d{1,19}$"
_MAX_TOKEN = 2**63 - 1


@router.get("", response_model=SharedGrantList, dependencies=[Depends(require(Action.READ_STATE))])
async def list_shared_grants(
    request: Request,
    prefix: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._:\-]{0,200}$")] = None,
    holder: Annotated[str | None, Query(pattern=OWNER_PATTERN, max_length=200)] = None,
    cursor: Annotated[str | None, Query(pattern=GRANT_CURSOR_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> SharedGrantList:
    """Live grants of every shared lock and semaphore, by resource then token (for dashboards, as
    `GET /v1/locks` lists mutex leases). Filter by resource prefix or holder; page with `cursor`."""
    after = None
    if cursor is not None:
        resource, token = cursor.rsplit("/", 1)
        after = (resource, min(int(token), _MAX_TOKEN))
    async with request.app.state.read_pool.acquire() as conn:
        page = await list_grants(conn, prefix=prefix, holder=holder, cursor=after, limit=limit)
    next_cursor = None if page.next_cursor is None else "{}/{}".format(*page.next_cursor)
    return SharedGrantList(at=page.at, items=[_listed(g) for g in page.items], next_cursor=next_cursor)


def _listed(listed: ListedGrant) -> ListedSharedGrant:
    grant = listed.holder.grant
    return ListedSharedGrant(
        resource=listed.resource, owner=grant.owner, mode=grant.mode, limit=grant.limit,
        fencing_token=grant.fencing_token, ttl_ms=grant.ttl_ms, granted_at=listed.holder.granted_at,
        expires_at=grant.expires_at,
    )  # fmt: skip


@router.get(
    "/{resource}",
    response_model=SharedLockInfo,
    responses={404: {"description": "never taken"}},
    dependencies=[Depends(require(Action.READ_STATE))],
)
async def get_shared_lock(resource: ResourcePath, request: Request) -> SharedLockInfo:
    """The live grants of a shared lock and the acquires queued for it (first in line first)."""
    async with request.app.state.read_pool.acquire() as conn:
        taken = await conn.fetchval("SELECT true FROM shared_locks WHERE resource = $1", resource)
        holders = await holders_of(conn, resource)
        waiting = await queue_of(conn, stream_id(resource))
    if not taken:
        raise HTTPException(404, f"{resource} has never been taken as a shared lock")
    return SharedLockInfo(
        resource=resource,
        limit=holders[0].grant.limit if holders else None,
        holders=[_holder(h) for h in holders],
        queue=[_waiter(w) for w in waiting],
    )


def _holder(holder: GrantRow) -> SharedHolder:
    grant = holder.grant
    return SharedHolder(
        owner=grant.owner, mode=grant.mode, fencing_token=grant.fencing_token, ttl_ms=grant.ttl_ms,
        granted_at=holder.granted_at, expires_at=grant.expires_at,
    )  # fmt: skip


def _waiter(waiting: Waiting) -> SharedWaiter:
    mode: Mode = "exclusive" if waiting.exclusive else "shared"
    return SharedWaiter(owner=waiting.owner, mode=mode, since=waiting.since, deadline=waiting.deadline)


@router.get(
    "/{resource}/history",
    response_model=History,
    dependencies=[Depends(require(Action.READ_HISTORY))],
    responses=ARCHIVED,
)
async def shared_history(
    resource: ResourcePath, request: Request, response: Response, window: Window
) -> History:
    """The shared lock's events (stream `shared/{resource}`: grants, renewals, releases, expiries) in
    order, as `GET /v1/locks/{resource}/history` gives the mutex's; page with `after_version`."""
    return await stream_history(request, response, resource, stream_id(resource), window)
