"""Reservation endpoints: several locks taken, renewed and released as one (``domain/reservation.py``).

The same roles, headers, owner rule and problems as the lock commands (``api/commands.py``); a refusal
names the resource (and for ``lock_held`` every held resource with its holder in ``conflicts``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response
from pydantic import BaseModel

from api.command_route import CommandCall, CommandRoute
from api.commands import Holder, lease_owner, problems, render_outcome
from api.reservation_models import (
    ReleaseReservationRequest,
    RenewReservationRequest,
    Reservation,
    ReservationReleased,
    ReserveRequest,
)
from domain.reservation import (
    RESERVATION_ID_MAX_LENGTH,
    RESERVATION_ID_PATTERN,
    ReleaseReservation,
    RenewReservation,
    ReservationCommand,
    Reserve,
    ReservedLease,
)
from service.reservation_service import ReservationService

router = APIRouter(prefix="/v1/reservations", tags=["reservations"], route_class=CommandRoute)

ReservationPath = Annotated[
    str,
    Path(
        pattern=RESERVATION_ID_PATTERN,
        min_length=1,
        max_length=RESERVATION_ID_MAX_LENGTH,
        description="The reservation id the reserve answered.",
    ),
]


def _service(request: Request) -> ReservationService:
    service: ReservationService = request.app.state.reservation_service
    return service


async def _run(
    command: ReservationCommand,
    call: CommandCall,
    request: Request,
    model: type[BaseModel],
    status_code: int = 200,
) -> Response:
    """Execute ``command`` and render its outcome as a lock command's is (``api/commands.py``)."""
    executing = _service(request).execute(command, call.context, call.disconnected)
    return await render_outcome(executing, call, model, status_code)


@router.post("", status_code=201, response_model=Reservation, responses=problems(409, 422, 503))
async def reserve(body: ReserveRequest, call: Holder, request: Request) -> Response:
    """Take every resource for one `ttl_ms`, all or none, each with its own fencing token, waiting up to
    `wait_ms` while any is held (holding none meanwhile). 409 `lock_held` names every held resource and
    its holder (`conflicts`)."""
    service = _service(request)
    ttl_ms = body.ttl_ms if body.ttl_ms is not None else service.default_ttl_ms
    reservation_id = body.reservation_id or service.new_id(call.context)
    owner = lease_owner(body.owner, call.caller)
    command = Reserve(reservation_id, tuple(body.resources), owner, ttl_ms, body.wait_ms)
    return await _run(command, call, request, Reservation, status_code=201)


@router.post("/{reservation_id}/renew", response_model=Reservation, responses=problems(409, 410, 422, 503))
async def renew(
    reservation_id: ReservationPath, body: RenewReservationRequest, call: Holder, request: Request
) -> Response:
    """The set's heartbeat: every named lease renewed to one deadline, or none (409 `not_holder`, 410
    `lease_expired` naming the first resource that is not held). 403 when a lease is another's."""
    leases = tuple(ReservedLease(lease.resource, lease.fencing_token) for lease in body.leases)
    command = RenewReservation(reservation_id, lease_owner(body.owner, call.caller), leases, body.ttl_ms)
    return await _run(command, call, request, Reservation)


@router.post(
    "/{reservation_id}/release", response_model=ReservationReleased, responses=problems(409, 410, 422, 503)
)
async def release(
    reservation_id: ReservationPath, body: ReleaseReservationRequest, call: Holder, request: Request
) -> Response:
    """End the named leases (all of the set, or the one a vehicle has left), all or none."""
    leases = tuple(ReservedLease(lease.resource, lease.fencing_token) for lease in body.leases)
    command = ReleaseReservation(reservation_id, lease_owner(body.owner, call.caller), leases)
    return await _run(command, call, request, ReservationReleased)
