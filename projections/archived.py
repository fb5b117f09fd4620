"""Which instants of the log are archived: replay, history and export refuse them by name.

Archived partitions (``eventstore/archive.py``) are no longer in the events table, so a query over a
span they cover would silently miss their events. :func:`refuse_archived` raises :class:`Archived`,
naming each archive file and how to bring it back, whenever a span touches one. A query with no lower
bound starts at the live log instead: :func:`live_since` says where that is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from eventstore.connection import Connection

OVERLAPPING_SQL = """
SELECT partition, lower_bound, upper_bound, file_name
  FROM event_archives
 WHERE restored_at IS NULL
   AND upper_bound > coalesce($1::timestamptz, '-infinity')
   AND lower_bound <= coalesce($2::timestamptz, 'infinity')
 ORDER BY lower_bound
"""
LIVE_SINCE_SQL = "SELECT max(upper_bound) FROM event_archives WHERE restored_at IS NULL"


@dataclass(frozen=True, slots=True)
class ArchivedSpan:
    partition: str
    start: datetime
    end: datetime
    file_name: str

    @property
    def restore(self) -> str:
        return f"lockledger restore {self.file_name}"


class Archived(LookupError):
    """A span of the log that is in archive files only, not in the database."""

    def __init__(self, spans: list[ArchivedSpan]) -> None:
        self.spans = spans
        names = ", ".join(span.file_name for span in spans)
        super().__init__(
            f"the events asked for are archived, in {names}; restore with `{spans[0].restore}`"
            " (and any other file named), or ask about a later span"
        )


async def refuse_archived(conn: Connection, start: datetime | None, end: datetime | None) -> None:
    """Raise :class:`Archived` when ``[start, end]`` (None: unbounded) touches an archived partition."""
    rows = await conn.fetch(OVERLAPPING_SQL, start, end)
    if rows:
        raise Archived(
            [ArchivedSpan(r["partition"], r["lower_bound"], r["upper_bound"], r["file_name"]) for r in rows]
        )


async def live_since(conn: Connection) -> datetime | None:
    """Where the live log begins: the end of the newest archived partition (None: nothing archived)."""
    found: datetime | None = await conn.fetchval(LIVE_SINCE_SQL)
    return found
