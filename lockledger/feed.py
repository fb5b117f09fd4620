"""The change feed for the SDK: a small server-sent events parser and the events it yields.

The server (``GET /v1/events/stream``) sends ``id:``, ``event:`` and ``data:`` lines, a blank line after
each message, and keep-alive comments (lines starting with ``:``). This parser follows the WHATWG rules
that matter for it (field names, one optional space after the colon, ``data`` lines joined with newlines,
``\\r\\n``, ``\\r`` or ``\\n`` line ends) without a dependency: the SDK depends on httpx and stamina only.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, replace

from lockledger.event import Event

__all__ = ["FeedEvent", "FeedOverflow", "SseMessage", "SseParser", "feed_event", "parse_sse"]

FeedEvent = Event  # the feed yields the log's one event record; the name stays for existing imports


@dataclass(frozen=True, slots=True)
class SseMessage:
    event: str  # "message" when the server named none
    data: str
    id: str | None  # None: the message carried no id


class SseParser:
    """Sans-I/O: give it an event stream's lines one by one (without their line ends, as httpx's
    ``iter_lines``/``aiter_lines`` yield them); a blank line completes a message, which ``feed`` returns.
    A message cut off before its blank line is never returned."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._last_id: str | None = None
        self._has_id = False

    def feed(self, line: str) -> SseMessage | None:
        if line == "":
            message = None
            if self._data:
                message = SseMessage(
                    self._event or "message", "\n".join(self._data), self._last_id if self._has_id else None
                )
            self._event, self._data, self._has_id = "", [], False  # the id is kept: it is the last event id
            return message
        if line.startswith(":"):
            return None  # a comment: the keep-alive
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self._last_id, self._has_id = value, True
        return None


async def parse_sse(lines: AsyncIterable[str]) -> AsyncIterator[SseMessage]:
    """The messages of an event stream, given its lines."""
    parser = SseParser()
    async for line in lines:
        message = parser.feed(line)
        if message is not None:
            yield message


def feed_event(message: SseMessage) -> Event:
    """The event a feed message carries: its data is one export line; its id is where to resume."""
    event = Event.from_line(message.data)
    return replace(event, id=message.id or str(event.position))


@dataclass(frozen=True, slots=True)
class FeedOverflow:
    """The server's ``event: overflow``: this client fell behind and is disconnected; resume there."""

    last_event_id: str

    @classmethod
    def from_message(cls, message: SseMessage) -> FeedOverflow:
        body = json.loads(message.data)
        return cls(str(body.get("last_event_id") or message.id or ""))
