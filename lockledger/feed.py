"""The change feed for the SDK: a small server-sent events parser and the events it yields.

The server (``GET /v1/events/stream``) sends ``id:``, ``event:`` and ``data:`` lines, a blank line after
each message, and keep-alive comments (lines starting with ``:``). This parser follows the WHATWG rules
that matter for it (field names, one optional space after the colon, ``data`` lines joined with newlines,
``\\r\\n``, ``\\r`` or ``\\n`` line ends) without a dependency: the SDK depends on httpx and stamina only.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lockledger.replay import ExportedEvent

__all__ = ["FeedEvent", "FeedOverflow", "SseMessage", "parse_sse"]


@dataclass(frozen=True, slots=True)
class SseMessage:
    event: str  # "message" when the server named none
    data: str
    id: str | None  # None: the message carried no id


async def parse_sse(lines: AsyncIterable[str]) -> AsyncIterator[SseMessage]:
    """The messages of an event stream, given its lines (without their line ends, as
    ``httpx.Response.aiter_lines`` yields them). A message cut off before its blank line is dropped."""
    event, last_id, has_id = "", None, False
    data: list[str] = []
    async for line in lines:
        if line == "":
            if data:
                yield SseMessage(event or "message", "\n".join(data), last_id if has_id else None)
            event, data, has_id = "", [], False  # the id is kept: it is the last event id
            continue
        if line.startswith(":"):
            continue  # a comment: the keep-alive
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            last_id, has_id = value, True


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One event of the change feed: the export line's fields, and ``id``, the feed position to resume
    from (``Last-Event-ID``; ``<position>.<lo>.<hi>``)."""

    id: str
    position: int
    stream: str
    version: int
    type: str
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: datetime
    hash: str
    line: str  # the ``data:`` JSON exactly as sent

    @classmethod
    def from_message(cls, message: SseMessage) -> FeedEvent:
        exported = ExportedEvent.from_line(message.data)
        return cls(
            message.id or str(exported.position), exported.position, exported.stream, exported.version,
            exported.type, exported.data, exported.metadata, exported.recorded_at, exported.hash,
            message.data,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class FeedOverflow:
    """The server's ``event: overflow``: this client fell behind and is disconnected; resume there."""

    last_event_id: str

    @classmethod
    def from_message(cls, message: SseMessage) -> FeedOverflow:
        body = json.loads(message.data)
        return cls(str(body.get("last_event_id") or message.id or ""))
