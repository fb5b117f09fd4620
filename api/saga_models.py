"""Saga request and response bodies (pydantic v2), shown in the OpenAPI at /docs.

The bounds are the server's: 1-32 steps, 16 locks a step, a step's result at most 4 KiB of JSON, ids and
step names one URL path segment. Text that is stored has no NUL (PostgreSQL cannot store it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.models import Owner, Timestamp, WholeNumber
from domain.resource import RESOURCE_MAX_LENGTH, RESOURCE_PATTERN
from domain.saga import (
    MAX_LOCKS_PER_ROUTE,
    MAX_LOCKS_PER_STEP,
    MAX_RESULT_BYTES,
    MAX_STEPS,
    SAGA_ID_MAX_LENGTH,
    SAGA_ID_PATTERN,
)

SagaId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=SAGA_ID_MAX_LENGTH,
        pattern=SAGA_ID_PATTERN,
        description="1-100 characters of A-Z, a-z, 0-9 and . _ : - (not only dots)",
    ),
]
Resource = Annotated[str, Field(min_length=1, max_length=RESOURCE_MAX_LENGTH, pattern=RESOURCE_PATTERN)]
Text = Annotated[str, Field(min_length=1, max_length=1000, pattern=r"^[^\x00]*$")]
SagaName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00]*$")]
SagaStatus = Literal["running", "compensating", "completed", "aborted", "stuck"]
StepStatus = Literal["pending", "running", "completed", "failed", "compensating", "compensated"]
Policy = Literal["compensate", "forward"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StepSpec(_Body):
    name: SagaId
    locks: list[Resource] = Field(
        default_factory=list, max_length=MAX_LOCKS_PER_STEP, description="The resources the step locks."
    )
    route: bool = Field(
        default=False,
        description="Take the locks as one reservation: all or none, each lock once, at most"
        f" {MAX_LOCKS_PER_ROUTE}; the step's `reservation_id` names it in the locks' events.",
    )


class CreateSagaRequest(_Body):
    saga_id: SagaId | None = Field(default=None, description="Chosen by the server when left out.")
    name: SagaName
    owner: str | None = Owner
    steps: list[StepSpec] = Field(
        min_length=1, max_length=MAX_STEPS, description="Run in this order; names must be unique (else 409)."
    )
    policy: Policy = Field(default="compensate", description="What recovery does with an unfinished saga.")
    lease_ms: WholeNumber | None = Field(
        default=None,
        description="The saga's own lease, renewed by `POST /v1/sagas/{id}/heartbeat` and by every"
        " transition; the server default (30 s) if omitted. Bounded like a lock's `ttl_ms`. When it lapses"
        " the reaper compensates the saga (or records the lapse, for `forward`); a second lapse makes it"
        " `stuck`.",
    )


class CompleteStepRequest(_Body):
    result: dict[str, Any] | None = Field(
        default=None,
        description=f"What the step recorded, handed to its compensation later; at most {MAX_RESULT_BYTES}"
        " bytes of JSON.",
    )


class ReasonRequest(_Body):
    reason: Text


class SagaStep(BaseModel):
    name: str
    locks: list[str]
    status: StepStatus
    result: dict[str, Any] | None
    error: str | None
    compensation_failures: int
    route: bool = Field(description="The step takes its locks as one reservation.")
    reservation_id: str | None = Field(description="A route step's reservation; null for other steps.")


class Saga(BaseModel):
    saga_id: str
    name: str
    owner: str
    policy: Policy
    status: SagaStatus
    reason: str | None
    steps: list[SagaStep]
    version: int
    started_at: Timestamp
    updated_at: Timestamp
    lease_ms: int | None = Field(description="The saga's lease; null for a saga started without one.")
    lease_expires_at: Timestamp | None = Field(
        description="The lease's deadline by the database clock; null once the saga has ended."
    )
    lease_lapsed_at: Timestamp | None = Field(
        description="When the lease last lapsed with no heartbeat since; null otherwise."
    )


class SagaList(BaseModel):
    items: list[Saga]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class TimelineEntry(BaseModel):
    position: int
    version: int
    type: str
    data: dict[str, Any]
    recorded_at: Timestamp


class SagaDetail(Saga):
    timeline: list[TimelineEntry]
