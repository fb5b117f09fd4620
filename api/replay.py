"""Endpoints for incident investigators: the fleet at a past instant, what changed, timelines, export.

All read the log through the read pool (``LOCKLEDGER_READ_DATABASE_URL``: a replica can serve them).
The fleet at an instant and what changed around it are lock state, past: the roles that read the state
(dashboard too, for its time slider) read them. An agent's timeline and the export are the history:
investigator or admin. Instants are RFC 3339 with an offset.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import pydantic_core
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from api.auth import require
from api.models import AgentEvent, AgentHistory, Change, Changes, Instant, ReplayState
from api.request_checks import StrictRoute
from domain.access import Action
from domain.resource import OWNER_PATTERN
from domain.timestamps import format_timestamp
from eventstore.connection import Connection
from projections import replay
from projections.archived import live_since, refuse_archived

router = APIRouter(tags=["replay"], route_class=StrictRoute)

# On answers that read only the live log while older partitions are archived: where the live log begins.
LIVE_SINCE_HEADER = "Lockledger-Live-Since"
ARCHIVED: dict[int | str, dict[str, Any]] = {
    410: {"description": "The span asked about is archived: `archives` names each file and its restore"}
}

ReadState = [Depends(require(Action.READ_STATE))]
ReadHistory = [Depends(require(Action.READ_HISTORY))]

At = Annotated[Instant, Query(description="RFC 3339 with an offset, e.g. 2026-05-05T14:02:07Z.")]
Prefix = Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._:\-]{0,200}$", description="Resource prefix.")]
Owner = Annotated[str | None, Query(pattern=OWNER_PATTERN, max_length=200, description="Lease owner.")]
Limit = Annotated[int, Query(ge=1, le=1000)]
AfterPosition = Annotated[int, Query(ge=0, lt=2**63, description="Resume after this global position.")]


def _invalid(field: str, message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("query", field), "msg": message, "type": "value_error"}])


def _lookback(request: Request, at: datetime) -> datetime:
    """How far before ``at`` a lease live at ``at`` may have been granted: the longest TTL."""
    try:
        return at - timedelta(milliseconds=request.app.state.settings.ttl_bounds.max_ms)
    except OverflowError:  # an instant within the longest TTL of year 1
        return datetime.min.replace(tzinfo=UTC)


async def mark_live_since(conn: Connection, response: Response) -> None:
    """An open-ended query reads the live log: say where it begins when older partitions are archived."""
    since = await live_since(conn)
    if since is not None:
        response.headers[LIVE_SINCE_HEADER] = format_timestamp(since)


@router.get("/v1/replay/state", response_model=ReplayState, dependencies=ReadState, responses=ARCHIVED)
async def state(
    request: Request,
    at: At,
    prefix: Prefix = None,
    owner: Owner = None,
    cursor: Annotated[
        str | None,
        Query(
            pattern=replay.STATE_CURSOR_PATTERN,
            max_length=220,
            description="The `next_cursor` of the page before: a resource, or `resource/token` after a"
            " shared-lock grant.",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000, description="Up to 10,000: a whole fleet at once.")] = 100,
) -> Response:
    """Every lease live at `at`, by resource: its holder, fencing token, when it was acquired and the
    deadline as known at that instant. A lease whose deadline had passed is not live, whether or not its
    `LOCK_EXPIRED` was recorded yet. Shared-lock grants live at `at` are listed too, after the mutex of
    the same name, with their `mode` and `limit`."""
    async with request.app.state.read_pool.acquire() as conn:
        await refuse_archived(conn, _lookback(request, at), at)
        try:
            found = await replay.state_at(conn, at, prefix=prefix, owner=owner, cursor=cursor, limit=limit)
        except replay.FutureInstant as error:
            raise _invalid("at", str(error)) from error
    return Response(state_json(found), media_type="application/json")


def state_json(found: replay.StateAt) -> bytes:
    """The ``ReplayState`` document for ``found``, around the leases PostgreSQL rendered: a whole fleet is
    thousands of leases, and decoding and rendering them here took longer than the query.
    ``tests/replay/test_replay_http.py`` holds it equal to the model's own rendering."""
    head = pydantic_core.to_json({"at": format_timestamp(found.at), "position": found.position})
    cursor = pydantic_core.to_json(found.next_cursor)
    return b"".join((head[:-1], b',"locks":', found.locks_json.encode(), b',"next_cursor":', cursor, b"}"))


@router.get(
    "/v1/replay/changes",
    response_model=Changes,
    response_model_by_alias=True,
    dependencies=ReadState,
    responses=ARCHIVED,
)
async def changes(
    request: Request,
    start: Annotated[Instant, Query(alias="from", description="Exclusive: the state at `from` is the base.")],
    to: Annotated[Instant, Query(description="Inclusive.")],
    prefix: Prefix = None,
    owner: Owner = None,
    cursor: Annotated[str | None, Query(pattern=replay.CHANGE_CURSOR_PATTERN)] = None,
    limit: Limit = 100,
) -> Changes:
    """What changed after `from` up to `to`, in time order: the events recorded, and the leases whose
    deadline passed with nothing recorded for them yet (`LEASE_LAPSED`)."""
    if to < start:
        raise _invalid("to", "`to` is before `from`")
    async with request.app.state.read_pool.acquire() as conn:
        await refuse_archived(conn, _lookback(request, start), to)
        page = await replay.changes(conn, start, to, prefix=prefix, owner=owner, cursor=cursor, limit=limit)
    items = [Change.model_validate(change, from_attributes=True) for change in page.changes]
    return Changes(from_=start, to=to, changes=items, next_cursor=page.next_cursor)


@router.get(
    "/v1/agents/{owner}/history", response_model=AgentHistory, dependencies=ReadHistory, responses=ARCHIVED
)
async def agent_history(
    request: Request,
    response: Response,
    owner: Annotated[str, Path(pattern=OWNER_PATTERN, max_length=200)],
    start: Annotated[Instant | None, Query(alias="from", description="Inclusive.")] = None,
    end: Annotated[Instant | None, Query(alias="to", description="Exclusive.")] = None,
    after_position: AfterPosition = 0,
    limit: Limit = 100,
) -> AgentHistory:
    """One agent's events across every resource, in log order; page with `after_position`."""
    async with request.app.state.read_pool.acquire() as conn:
        if start is None:
            await mark_live_since(conn, response)
        else:
            await refuse_archived(conn, start, end)
        found = await replay.agent_history(
            conn, owner, after_position=after_position, start=start, end=end, limit=limit
        )
    items = [AgentEvent.model_validate(event, from_attributes=True) for event in found]
    next_after = items[-1].position if len(items) == limit else None
    return AgentHistory(owner=owner, events=items, next_after_position=next_after)


@router.get(
    "/v1/events",
    dependencies=ReadHistory,
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/x-ndjson": {}}, "description": "One event per line."},
        **ARCHIVED,
    },
)
async def export(
    request: Request,
    start: Annotated[Instant | None, Query(alias="from", description="Inclusive.")] = None,
    end: Annotated[Instant | None, Query(alias="to", description="Exclusive.")] = None,
    after_position: AfterPosition = 0,
    type: Annotated[str | None, Query(pattern=r"^[A-Z_]{1,64}$", description="Event type.")] = None,
    owner: Owner = None,
    prefix: Prefix = None,
) -> StreamingResponse:
    """The log as NDJSON, one event per line (position, stream, version, event_id, type, data, metadata,
    recorded_at, hash), in position order and constant memory. A broken download resumes with
    `after_position` set to the last position received."""
    pool = request.app.state.read_pool
    headers: dict[str, str] = {}
    async with pool.acquire() as conn:
        if start is None:
            since = await live_since(conn)
            if since is not None:
                headers[LIVE_SINCE_HEADER] = format_timestamp(since)
        else:
            await refuse_archived(conn, start, end)

    async def lines() -> AsyncIterator[bytes]:
        async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            batch: list[str] = []
            async for line in replay.export_lines(
                conn, after_position=after_position, start=start, end=end, event_type=type, owner=owner,
                prefix=prefix,
            ):  # fmt: skip
                batch.append(line)
                if len(batch) == 500:
                    yield ("\n".join(batch) + "\n").encode()
                    batch.clear()
            if batch:
                yield ("\n".join(batch) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)
