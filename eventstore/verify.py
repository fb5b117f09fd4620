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

    @property
    def ok(self) -> bool:
        return self.broken is None


async def verify_chains(
    conn: Connection, progress: Callable[[int], None] | None = None, batch: int = 10_000
) -> VerifyReport:
    """Walk every stream in version order; stop at the first event whose hash does not match."""
    count = streams = 0
    stream: str | None = None
    previous = b""
    expected_version = 0
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        async for row in conn.cursor(READ_SQL, prefetch=batch):
            if row["stream_id"] != stream:
                stream, previous, expected_version = row["stream_id"], b"", 0
                streams += 1
            expected_version += 1
            if row["stream_version"] != expected_version:
                return VerifyReport(
                    count,
                    streams,
                    BrokenLink(row["stream_id"], expected_version, f"version {expected_version} is missing"),
                )
            digest = event_hash(
                previous,
                row["stream_id"],
                row["stream_version"],
                row["event_id"],
                row["event_type"],
                row["data"],
                row["metadata"],
                row["recorded_at"],
            )
            if digest != bytes(row["hash"]):
                return VerifyReport(
                    count,
                    streams,
                    BrokenLink(
                        row["stream_id"], row["stream_version"], "hash does not match the event's content"
                    ),
                )
            previous = digest
            count += 1
            if progress is not None and count % batch == 0:
                progress(count)
    return VerifyReport(count, streams, None)
