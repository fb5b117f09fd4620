"""One record for an event of the log, however it was read: a resource's history, an agent's history,
the export and the change feed all return ``Event``.

The server sends the same event in each (``position``, ``stream``, ``version``, ``event_id``, ``type``,
``data``, ``metadata``, ``recorded_at``); the export and the feed add the chain ``hash`` and the line as
sent (``line``: an archive written from it keeps the server's bytes), and the feed its resume id (``id``).
What a source does not send is None. Importing this module pulls in no server code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lockledger.errors import parse_datetime

__all__ = ["Event", "required_datetime"]


def required_datetime(value: Any) -> datetime:
    """An instant the server always sends; ``ValueError`` if it is missing."""
    parsed = parse_datetime(value)
    if parsed is None:
        raise ValueError("missing datetime")
    return parsed


@dataclass(frozen=True)
class Event:
    """One event of the log. ``stream`` is the resource (or saga) it belongs to; ``hash`` and ``line``
    come with the export and the feed, ``id`` (the ``Last-Event-ID`` to resume from) with the feed."""

    position: int
    stream: str
    version: int
    event_id: str
    type: str
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: datetime
    hash: str | None = None
    line: str | None = None
    id: str | None = None

    @property
    def resource(self) -> str:
        """The stream, by the name a lock's events use for it."""
        return self.stream

    @classmethod
    def from_json(
        cls, d: dict[str, Any], *, stream: str | None = None, line: str | None = None, id: str | None = None
    ) -> Event:
        """An event as the server writes it; ``stream`` for a page that names it once for all its events
        (a resource's history). ``ValueError`` for an object that is not a whole event."""
        try:
            return cls(
                int(d["position"]), str(stream or d.get("stream") or d["resource"]), int(d["version"]),
                str(d["event_id"]), d["type"], d["data"], d["metadata"], required_datetime(d["recorded_at"]),
                None if d.get("hash") is None else str(d["hash"]), line, id,
            )  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an event: {str(d)[:80]!r}") from exc

    @classmethod
    def from_line(cls, line: str, *, id: str | None = None) -> Event:
        """One export line (or a feed message's data), kept as ``line``; ``ValueError`` for a line that is
        not a whole event (a connection cut inside it)."""
        try:
            d = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"not an exported event: {line[:80]!r}") from exc
        if not isinstance(d, dict):
            raise ValueError(f"not an exported event: {line[:80]!r}")
        return cls.from_json(d, line=line, id=id)
