"""Request and response bodies of the shared locks (``api/shared_locks.py``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from api.models import Owner, Timestamp, WholeNumber, _whole_number
from domain.shared_lock import MAX_LIMIT

ModeField = Literal["shared", "exclusive"]
# A whole number (as ``WholeNumber``), its bounds before the coercion so the OpenAPI states them.
PermitCount = Annotated[int, Field(ge=1, le=MAX_LIMIT), BeforeValidator(_whole_number)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SharedAcquireRequest(_Body):
    owner: str | None = Owner
    mode: ModeField = Field(
        default="exclusive",
        description="`shared`: with other shared grants (a reader, or a semaphore's permit); `exclusive`:"
        " alone (a writer). Exclusive if omitted, the safe default.",
    )
    limit: PermitCount | None = Field(
        default=None,
        description="The most grants the lock may have at once: a semaphore's permits. Every holder names"
        " the same limit (409 `limit_mismatch` otherwise, until all are gone); none for a read/write lock.",
    )
    ttl_ms: WholeNumber | None = Field(
        default=None, description="Grant length; the server default (30 s) if omitted."
    )
    wait_ms: WholeNumber = Field(
        default=0,
        ge=0,
        le=2**31,
        description="Wait up to this long for a place (the server's `LOCKLEDGER_MAX_WAIT_MS` at most) before"
        " answering 409 `lock_held`. Waiters are served in arrival order on every server; a reader never"
        " overtakes a writer that waits. 0: answer at once.",
    )


class SharedRenewRequest(_Body):
    owner: str | None = Owner
    fencing_token: WholeNumber = Field(ge=1, le=2**62, description="The grant's token.")
    ttl_ms: WholeNumber | None = Field(
        default=None, description="New grant length; the current one if omitted."
    )


class SharedReleaseRequest(_Body):
    owner: str | None = Owner
    fencing_token: WholeNumber = Field(ge=1, le=2**62, description="The grant's token.")


class SharedGrant(BaseModel):
    resource: str
    owner: str
    mode: ModeField
    limit: int | None
    fencing_token: int = Field(
        description="This grant's token: strictly increasing per resource across both modes."
    )
    ttl_ms: int
    expires_at: Timestamp = Field(description="Deadline by the database clock.")


class SharedReleased(BaseModel):
    resource: str
    owner: str
    mode: ModeField
    fencing_token: int
    released: bool


class SharedHolder(BaseModel):
    owner: str
    mode: ModeField
    fencing_token: int
    ttl_ms: int
    granted_at: Timestamp
    expires_at: Timestamp


class SharedWaiter(BaseModel):
    owner: str
    mode: ModeField = Field(description="`exclusive` for a writer; `shared` for a reader or a permit.")
    since: Timestamp = Field(description="When it joined the queue (database clock).")
    deadline: Timestamp = Field(description="When its wait ends, and its place with it.")


class SharedLockInfo(BaseModel):
    resource: str
    limit: int | None = Field(description="The limit the live grants agreed on; none without one.")
    holders: list[SharedHolder] = Field(description="Live grants, by token.")
    queue: list[SharedWaiter] = Field(description="Acquires waiting, first in line first.")


class ListedSharedGrant(BaseModel):
    resource: str
    owner: str
    mode: ModeField
    limit: int | None = Field(description="The semaphore's permits; none for a read/write lock.")
    fencing_token: int
    ttl_ms: int
    granted_at: Timestamp
    expires_at: Timestamp


class SharedGrantList(BaseModel):
    """A page of live grants, shaped as ``LockList`` (``GET /v1/locks``)."""

    at: Timestamp = Field(description="The database time the list is as of (its snapshot's).")
    items: list[ListedSharedGrant] = Field(description="Live grants, by resource then token.")
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")
