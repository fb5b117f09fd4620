"""Request and response bodies of the reservation commands (``api/reservations.py``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from api.models import Owner, Timestamp, WholeNumber
from domain.reservation import MAX_RESOURCES, RESERVATION_ID_MAX_LENGTH, RESERVATION_ID_PATTERN
from domain.resource import RESOURCE_MAX_LENGTH, RESOURCE_PATTERN, RESOURCE_RULE

ResourceName = Annotated[
    str,
    Field(
        pattern=RESOURCE_PATTERN,
        min_length=1,
        max_length=RESOURCE_MAX_LENGTH,
        description=f"Resource id, e.g. `zone:A3`: {RESOURCE_RULE}.",
    ),
]
ReservationId = Annotated[
    str, Field(pattern=RESERVATION_ID_PATTERN, min_length=1, max_length=RESERVATION_ID_MAX_LENGTH)
]


def _each_once(resources: list[str]) -> list[str]:
    """A set has each resource once (the schema says ``uniqueItems``)."""
    if len(set(resources)) != len(resources):
        raise ValueError("each resource may be named once")
    return resources


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LeaseRef(_Body):
    resource: ResourceName
    fencing_token: WholeNumber = Field(ge=1, le=2**62)


class ReserveRequest(_Body):
    owner: str | None = Owner
    resources: Annotated[list[ResourceName], AfterValidator(_each_once)] = Field(
        min_length=1,
        max_length=MAX_RESOURCES,
        json_schema_extra={"uniqueItems": True},
        description="Every resource to take, all or none; each at most once. Answered in this order.",
    )
    reservation_id: ReservationId | None = Field(
        default=None,
        description="Names the set in the log (each event's metadata). Made up by the server if left out:"
        " from the Idempotency-Key when one is sent, so a retry names the same reservation.",
    )
    ttl_ms: WholeNumber | None = Field(
        default=None, description="One lease length for the set; the server default (30 s) if omitted."
    )
    wait_ms: WholeNumber = Field(
        default=0,
        ge=0,
        le=2**31,
        description="If any resource is held, wait up to this long (the server's `LOCKLEDGER_MAX_WAIT_MS` at"
        " most) for all of them to be free at once, holding none meanwhile, before answering 409"
        " `lock_held`. 0: answer at once.",
    )


class RenewReservationRequest(_Body):
    owner: str | None = Owner
    leases: list[LeaseRef] = Field(
        min_length=1, max_length=MAX_RESOURCES, description="The leases of the set still held, with tokens."
    )
    ttl_ms: WholeNumber | None = Field(
        default=None, description="New lease length for every lease; their current one if omitted."
    )


class ReleaseReservationRequest(_Body):
    owner: str | None = Owner
    leases: list[LeaseRef] = Field(
        min_length=1,
        max_length=MAX_RESOURCES,
        description="The leases to end: the whole set, or the resource the vehicle has left.",
    )


class ReservedLease(BaseModel):
    resource: str
    fencing_token: int = Field(description="This resource's own token: pass it to writes about it.")


class Reservation(BaseModel):
    reservation_id: str
    owner: str
    leases: list[ReservedLease]
    expires_at: Timestamp = Field(description="The one deadline of every lease, by the database clock.")
    ttl_ms: int


class ReservationReleased(BaseModel):
    reservation_id: str
    owner: str
    leases: list[ReservedLease]
    released: bool
