"""Tamper evidence: recompute every stream's hash chain and name the first broken link.

The chain is computed by the ``events_chain_hash`` trigger at insert time; this is an independent
re-implementation in Python, so a bug or an edit on either side shows up as a mismatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from eventstore.connection import Connection

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

READ_SQL = """
SELECT stream_id, stream_version, event_id::text AS event_id, event_type, data::text AS data,
       metadata::text AS metadata, recorded_at, hash
  FROM events
 ORDER BY stream_id, stream_version
"""


def event_hash(
    previous: bytes,
    stream_id: str,
    version: int,
    event_id: str,
    event_type: str,
    data: str,
    metadata: str,
    recorded_at: datetime,
) -> bytes:
    micros = (recorded_at - _EPOCH) // timedelta(microseconds=1)
    text = "|".join([stream_id, str(version), event_id, event_type, data, metadata, str(micros)])
    return hashlib.sha256(previous + text.encode()).digest()


@dataclass(frozen=True, slots=True)
class BrokenLink:
    stream_id: str
    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    events: int
    streams: int
    broken: BrokenLink | None
    anchored: int = 0  # streams checked from their first live event on (ChainWalk's ``anchor``)

    @property
    def ok(self) -> bool:
        return self.broken is None


class ChainWalk:
    """Recompute hash chains over events fed in stream-version order, one stream after another.

    A walk may span several sources read one after another (archive files in time order, then the live
    log): it keeps each stream's last version and hash (``heads``), so a stream that goes on in the next
    source chains to where the previous one left it. The last source is walked with ``forget=True``: a
    stream's head is dropped once its run ends, so memory stays flat however many streams it holds.

    With ``anchor=True`` (the live log walked without the archives its older partitions went to), a
    stream whose first event here is past version 1 is taken as it is, its chain checked from there on:
    its link to the archived events cannot be, without their file. ``anchored`` counts those streams.
    """

    def __init__(self, heads: dict[str, tuple[int, bytes]] | None = None, *, anchor: bool = False) -> None:
        self.heads: dict[str, tuple[int, bytes]] = dict(heads or {})
        self.anchor = anchor
        self.anchored = 0
        self.events = 0
        self.streams = len(self.heads)
        self._current: str | None = None

    def step(
        self,
        stream_id: str,
        version: int,
        event_id: str,
        event_type: str,
        data: str,
        metadata: str,
        recorded_at: datetime,
        hash_: bytes,
        *,
        forget: bool = False,
    ) -> BrokenLink | None:
        """Check one event against its stream's previous one; the broken link, or None."""
        if stream_id != self._current:
            if forget and self._current is not None:
                self.heads.pop(self._current, None)
            self._current = stream_id
            if stream_id not in self.heads:
                self.streams += 1
        if self.anchor and version > 1 and stream_id not in self.heads:
            self.heads[stream_id] = (version, hash_)
            self.anchored += 1
            self.events += 1
            return None
        last_version, previous = self.heads.get(stream_id, (0, b""))
        if version != last_version + 1:
            return BrokenLink(stream_id, last_version + 1, f"version {last_version + 1} is missing")
        digest = event_hash(previous, stream_id, version, event_id, event_type, data, metadata, recorded_at)
        if digest != hash_:
            return BrokenLink(stream_id, version, "hash does not match the event's content")
        self.heads[stream_id] = (version, digest)
        self.events += 1
        return None

    def end_source(self) -> None:
        """The source being walked has ended: the next one starts its streams afresh."""
        self._current = None

    def report(self, broken: BrokenLink | None = None) -> VerifyReport:
        return VerifyReport(self.events, self.streams, broken, self.anchored)


async def verify_chains(
    conn: Connection,
    progress: Callable[[int], None] | None = None,
    batch: int = 10_000,
    walk: ChainWalk | None = None,
) -> VerifyReport:
    """Walk every stream in version order; stop at the first event whose hash does not match. ``walk``
    carries on a walk that earlier sources (archive files) began."""
    walk = walk if walk is not None else ChainWalk()
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        async for row in conn.cursor(READ_SQL, prefetch=batch):
            broken = walk.step(
                row["stream_id"],
                row["stream_version"],
                row["event_id"],
                row["event_type"],
                row["data"],
                row["metadata"],
                row["recorded_at"],
                bytes(row["hash"]),
                forget=True,
            )
            if broken is not None:
                return walk.report(broken)
            if progress is not None and walk.events % batch == 0:
                progress(walk.events)
    return walk.report()
