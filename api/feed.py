"""``GET /v1/events/stream``: the change feed as server-sent events (docs/semantics.md, "The change feed").

Each message: ``id:`` the subscriber's place (``<position>.<lo>.<hi>``, see ``eventstore/tail.py``; send it
back as ``Last-Event-ID`` to resume), ``event:`` the event type, ``data:`` the event as one NDJSON export
line. Keep-alive comments every ``LOCKLEDGER_FEED_KEEPALIVE_S`` seconds (15). A client whose queue
(``LOCKLEDGER_FEED_QUEUE_SIZE`` events, 1,000) fills gets ``event: overflow`` with where to resume, and
the stream ends.

A client that stops reading altogether cannot be sent ``overflow``: its TCP window is full. The send
then waits until the HTTP protocol's write deadline (``LOCKLEDGER_HTTP_WRITE_TIMEOUT_S``,
``api/http_protocol.py``) aborts the connection and logs it in one line; the stream then ends as for any
client that hangs up. No send timeout of sse-starlette's own: it ended the stream by raising an error
that was logged with a traceback per client.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Annotated

import asyncpg
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from api.auth import require
from api.request_checks import StrictRoute
from domain.access import Action
from domain.resource import OWNER_PATTERN
from eventstore.tail import CURSOR_PATTERN, Cursor, Filter, parse_cursor
from service.feed import Feed, FutureCursor

router = APIRouter(tags=["feed"], route_class=StrictRoute, dependencies=[Depends(require(Action.READ_FEED))])


# Messages ready at once are joined into writes of about this size (the transport's high-water mark):
# a window reaches 20 dashboards in 20 writes, not one per event each, and a catch-up page does not sit
# whole in the write buffer of a client that does not read.
CHUNK_BYTES = 64 * 1024
_FELL_BEHIND = "this client fell too far behind; reconnect with Last-Event-ID to resume"


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def keepalive_s() -> float:
    return _env_float("LOCKLEDGER_FEED_KEEPALIVE_S", 15.0)


async def start_feed(pool: asyncpg.Pool) -> Feed:
    """The process's one reader, on ``pool`` (the read pool), started."""
    feed = Feed(
        pool,
        poll_s=_env_float("LOCKLEDGER_FEED_POLL_MS", 100.0) / 1000,
        queue_size=int(_env_float("LOCKLEDGER_FEED_QUEUE_SIZE", 1000)),
    )
    await feed.start()
    return feed


def _invalid(field: tuple[str, str], message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": field, "msg": message, "type": "value_error"}])


@router.get(
    "/v1/events/stream",
    response_class=EventSourceResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "Server-sent events, one per event (`id`, `event`, `data`); never ends by itself.",
        }
    },
)
async def stream(
    request: Request,
    after_position: Annotated[
        int | None, Query(ge=0, lt=2**63, description="Start after this position (no header given).")
    ] = None,
    prefix: Annotated[
        str | None, Query(pattern=r"^[A-Za-z0-9._:/\-]{0,200}$", description="Stream prefix.")
    ] = None,
    owner: Annotated[str | None, Query(pattern=OWNER_PATTERN, max_length=200)] = None,
    type: Annotated[str | None, Query(pattern=r"^[A-Z_]{1,64}$", description="Event type.")] = None,
    saga: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._:\-]{1,200}$", description="Saga id.")] = None,
    last_event_id: Annotated[
        str | None,
        Header(pattern=CURSOR_PATTERN, description="The last `id` received; wins over `after_position`."),
    ] = None,
) -> EventSourceResponse:
    """Follow the log as it grows: every matching event once, gap-free even for late commits, from a
    position (`after_position`, or `Last-Event-ID`, which wins) or from now. Filters: `prefix` (stream),
    `owner`, `type`, `saga` (the saga's stream and the lock events it caused)."""
    feed: Feed = request.app.state.feed
    after, cursor = after_position, None
    if last_event_id is not None:
        try:
            after, cursor = parse_cursor(last_event_id)
        except ValueError as exc:
            raise _invalid(("header", "last-event-id"), str(exc)) from exc
    flt = Filter(prefix=prefix or None, owner=owner, type=type, saga=saga)
    try:
        subscription, deliveries = await feed.subscribe(flt, after=after, cursor=cursor)
    except FutureCursor as exc:
        raise _invalid(("header", "last-event-id"), str(exc)) from exc

    async def messages() -> AsyncIterator[bytes]:
        """A batch of deliveries as few writes as fit: messages joined up to ``CHUNK_BYTES`` each."""
        place: Cursor = subscription.start
        try:
            async for batch in deliveries:
                chunk: list[bytes] = []
                size = 0
                for item in batch:
                    if isinstance(item, str):  # OVERFLOW, always a batch's last
                        detail = {"detail": _FELL_BEHIND, "last_event_id": str(place)}
                        message = ServerSentEvent(data=json.dumps(detail), event="overflow", id=str(place))
                    else:
                        place = item.cursor
                        message = ServerSentEvent(data=item.event.line, event=item.event.type, id=str(place))
                    chunk.append(message.encode())
                    size += len(chunk[-1])
                    if size >= CHUNK_BYTES:
                        yield b"".join(chunk)
                        chunk, size = [], 0
                if chunk:
                    yield b"".join(chunk)
        finally:
            feed.unsubscribe(subscription)
            request.app.state.memory.trim_soon()

    return EventSourceResponse(
        messages(),
        ping=keepalive_s(),
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
