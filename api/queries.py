"""Query endpoints for dashboards: current locks, one lock, a lock's history (for investigators)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response

from api.auth import require
from api.dependencies import ResourcePath
from api.models import History, HistoryEvent, Instant, LockInfo, LockList, QueuedAcquire
from api.replay import ARCHIVED, mark_live_since
from api.request_checks import StrictRoute
from domain.access import Action
from domain.resource import OWNER_PATTERN, RESOURCE_PATTERN
from projections import queries, replay
from projections.archived import refuse_archived
from service.queue_store import queue_of

router = APIRouter(prefix="/v1/locks", tags=["queries"], route_class=StrictRoute)


ReadState = [Depends(require(Action.READ_STATE))]


@router.get("", response_model=LockList, dependencies=ReadState)
async def list_locks(
    request: Request,
    holder: Annotated[str | None, Query(pattern=OWNER_PATTERN, max_length=200)] = None,
    prefix: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._:\-]{0,200}$")] = None,
    expiring_within_ms: Annotated[int | None, Query(ge=0, le=86_400_000)] = None,
    cursor: Annotated[str | None, Query(pattern=RESOURCE_PATTERN, max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> LockList:
    """Live leases, by resource. Filter by holder, resource prefix, or deadline within the next N ms."""
    async with request.app.state.read_pool.acquire() as conn:
        page = await queries.list_locks(
            conn,
            holder=holder,
            prefix=prefix,
            expiring_within_ms=expiring_within_ms,
            cursor=cursor,
            limit=limit,
        )
    items = [LockInfo(**v.as_json()) for v in page.items]
    return LockList(at=page.at, items=items, next_cursor=page.next_cursor)


@router.get(
    "/{resource}",
    response_model=LockInfo,
    responses={404: {"description": "never locked"}},
    dependencies=ReadState,
)
async def get_lock(resource: ResourcePath, request: Request) -> LockInfo:
    """A lock's state and the acquires queued for it (``queue``, first in line first)."""
    async with request.app.state.read_pool.acquire() as conn:
        view = await queries.get_lock(conn, resource)
        waiting = [] if view is None else await queue_of(conn, resource)
    if view is None:
        raise HTTPException(404, f"{resource} has never been locked")
    queue = [QueuedAcquire(owner=w.owner, since=w.since, deadline=w.deadline) for w in waiting]
    return LockInfo(**view.as_json(), queue=queue)


@dataclass(frozen=True)
class HistoryWindow:
    """Which of a stream's events a history page shows: after a version, recorded in ``[start, end)``."""

    after_version: int
    start: datetime | None
    end: datetime | None
    limit: int


def history_window(
    # A bigint: larger is a 422, not a 500. `lt=2**63`, not `le=2**63 - 1`: FastAPI holds OpenAPI bounds
    # as floats, and only the power of two survives that exactly.
    after_version: Annotated[int, Query(ge=0, lt=2**63)] = 0,
    start: Annotated[Instant | None, Query(alias="from", description="Inclusive, RFC 3339.")] = None,
    end: Annotated[Instant | None, Query(alias="to", description="Exclusive, RFC 3339.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> HistoryWindow:
    """The history endpoints' query parameters (a mutex's and a shared lock's take the same)."""
    return HistoryWindow(after_version, start, end, limit)


Window = Annotated[HistoryWindow, Depends(history_window)]


async def stream_history(
    request: Request, response: Response, resource: str, stream: str, window: HistoryWindow
) -> History:
    """One page of the events of ``stream`` (the lock ``resource``'s), refusing an archived range."""
    async with request.app.state.read_pool.acquire() as conn:
        if window.start is None:
            await mark_live_since(conn, response)
        else:
            await refuse_archived(conn, window.start, window.end)
        found = await replay.resource_history(
            conn,
            stream,
            after_version=window.after_version,
            start=window.start,
            end=window.end,
            limit=window.limit,
        )
    items = [HistoryEvent.model_validate(event, from_attributes=True) for event in found]
    next_after = items[-1].version if len(items) == window.limit else None
    return History(resource=resource, events=items, next_after_version=next_after)


@router.get(
    "/{resource}/history",
    response_model=History,
    dependencies=[Depends(require(Action.READ_HISTORY))],
    responses=ARCHIVED,
)
async def history(resource: ResourcePath, request: Request, response: Response, window: Window) -> History:
    """The resource's events in order, recorded between `from` and `to` if given; page with
    `after_version`."""
    return await stream_history(request, response, resource, resource, window)
