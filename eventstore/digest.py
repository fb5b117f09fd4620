"""Log digest: one short value that pins every event up to a global position, to keep outside the system.

A stream's hash chain shows an event edited or removed from its middle, but not a stream's newest events
or a whole stream deleted. The digest closes that: it covers every stream's head at a position P (the
stream's last event at or before P, whose chain hash covers all its earlier events) and the number of
events at or before P. Verifying a digest kept elsewhere recomputes it at its position and re-runs the
chain verification (``eventstore/verify.py``), which together show any event at or before P altered,
inserted or removed.

Format, printable and self-describing::

    lldg1:<position>:<events>:<streams>:<sha256 hex>

The hash is SHA-256 over ``lldg1\\n<position>\\n<events>\\n``, then one line per stream head in position
order, ``json.dumps([stream, version, position, chain hash hex]) + "\\n"`` (JSON, so no stream name can
forge a line), then ``<streams>\\n``. Position order needs no collation, so a restored copy on
another server gives the same value.

Archived partitions (``eventstore/archive_file.py``) still count: given their files, oldest first, the
digest reads the events at or before P from them as from the live log, so a digest kept before an
archive run verifies after it, and the archive files are proved whole and unaltered with the log.

The position a digest covers must be settled: an insert still in flight may hold a lower position than a
committed one. Before reading, the digest waits (a bounded time) for the transactions that were running
when the newest position was read, so a later verification does not count their events as inserted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eventstore.archive_file import ArchiveSource, walk_archive
from eventstore.connection import Connection
from eventstore.verify import ChainWalk, VerifyReport, verify_chains

PREFIX = "lldg1"
_FORMAT = re.compile(rf"^{PREFIX}:(\d{{1,19}}):(\d{{1,19}}):(\d{{1,19}}):([0-9a-f]{{64}})$")

NEWEST_SQL = """
SELECT coalesce(max(position), 0) AS newest,
       array(SELECT x::text FROM pg_snapshot_xip(pg_current_snapshot()) AS x) AS running
  FROM events
"""
STILL_RUNNING_SQL = """
SELECT count(*) FROM unnest($1::text[]) AS x WHERE pg_xact_status(x::xid8) = 'in progress'
"""
COUNT_SQL = "SELECT count(*) FROM events WHERE position <= $1"
# DISTINCT ON walks the (stream_id, stream_version) order in the database; the client sees one row per
# stream, in position order, through a cursor.
HEADS_SQL = """
SELECT stream_id, stream_version, position, hash
  FROM (SELECT DISTINCT ON (stream_id) stream_id, stream_version, position, hash
          FROM events
         WHERE position <= $1
         ORDER BY stream_id, stream_version DESC) AS heads
 ORDER BY position
"""
# Ranges of positions in ($3, P] that hold no event ($3: the last archived position, or 0); a sentinel at
# P + 1 reports a missing tail.
GAPS_SQL = """
SELECT previous + 1 AS first, position - 1 AS last
  FROM (SELECT position, lag(position, 1, $3::bigint) OVER (ORDER BY position) AS previous
          FROM (SELECT position FROM events WHERE position <= $1 AND position > $3
                UNION ALL SELECT $1 + 1) AS p) AS s
 WHERE position > previous + 1
 ORDER BY first
 LIMIT $2
"""


@dataclass(frozen=True, slots=True)
class Archived:
    """What archive files hold at or before a position: the events' count and each stream's newest
    event there (version, position, hash)."""

    events: int
    heads: dict[str, tuple[int, int, bytes]]
    last_position: int  # the highest position any of the files holds, or 0

    @classmethod
    def read(cls, sources: Sequence[ArchiveSource], position: int) -> Archived:
        events, last = 0, 0
        heads: dict[str, tuple[int, int, bytes]] = {}
        for source in sources:
            with source.open() as reader:
                for event in reader:
                    last = max(last, event.position)
                    if event.position <= position:
                        events += 1
                        head = heads.get(event.stream_id)
                        if head is None or head[0] < event.stream_version:
                            heads[event.stream_id] = (event.stream_version, event.position, event.hash)
                source.check(reader)
        return cls(events, heads, last)


NOTHING_ARCHIVED = Archived(0, {}, 0)


class PositionBeyondLog(ValueError):
    """A digest was asked for at a position no event has reached yet."""


@dataclass(frozen=True, slots=True)
class Digest:
    position: int
    events: int
    streams: int
    sha256: str  # lowercase hex

    def __str__(self) -> str:
        return f"{PREFIX}:{self.position}:{self.events}:{self.streams}:{self.sha256}"

    @classmethod
    def parse(cls, text: str) -> Digest:
        found = _FORMAT.match(text.strip())
        if found is None:
            raise ValueError(f"not a log digest: expected {PREFIX}:<position>:<events>:<streams>:<hex>")
        position, events, streams, sha256 = found.groups()
        if int(position) >= 2**63:
            raise ValueError("not a log digest: its position is beyond any bigint")
        return cls(int(position), int(events), int(streams), sha256)


@dataclass(frozen=True, slots=True)
class DigestReport:
    """A kept digest against the log now: what differs, in words an investigator can act on."""

    expected: Digest
    actual: Digest
    chains: VerifyReport
    gaps: list[tuple[int, int]]  # the first ranges of positions in 1..P without an event

    @property
    def ok(self) -> bool:
        return self.chains.ok and self.actual == self.expected

    def findings(self) -> list[str]:
        expected, actual, p = self.expected, self.actual, self.expected.position
        found = []
        if (link := self.chains.broken) is not None:
            found.append(f"broken chain: stream {link.stream_id} version {link.version}: {link.reason}")
        if actual.events != expected.events:
            change = "removed" if actual.events < expected.events else "inserted"
            found.append(
                f"{abs(actual.events - expected.events)} event(s) {change} at or before position {p}: the"
                f" digest counted {expected.events}, the log now has {actual.events}"
            )
        if actual.streams != expected.streams:
            change = "removed" if actual.streams < expected.streams else "added"
            found.append(
                f"{abs(actual.streams - expected.streams)} whole stream(s) {change}: the digest counted"
                f" {expected.streams} streams up to position {p}, the log now has {actual.streams}"
            )
        missing, before = p - actual.events, p - expected.events
        if missing != before and self.gaps:
            ranges = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in self.gaps)
            more = ", ..." if sum(b - a + 1 for a, b in self.gaps) < missing else ""
            found.append(
                f"{missing} position(s) in 1..{p} hold no event: {ranges}{more}; {before} held none already"
                " when the digest was taken (a transaction that rolled back leaves a gap too)"
            )
        if actual.sha256 != expected.sha256:
            found.append(
                f"the stream heads at position {p} differ from the digest's: a stream's last event at or"
                " before it was changed, removed or added. The digest alone cannot say which stream;"
                f" compare each stream's last (version, hash) at or before {p} with an NDJSON export"
                " (GET /v1/events) taken with the digest"
            )
        return found


async def compute_digest(
    conn: Connection,
    position: int | None = None,
    progress: Callable[[int], None] | None = None,
    batch: int = 10_000,
    archives: Sequence[ArchiveSource] = (),
) -> Digest:
    """The digest of every event up to ``position`` (default: the newest), in the live log and in the
    ``archives`` files; ``progress`` gets the number of stream heads hashed so far. Raises
    :class:`PositionBeyondLog` past the newest event."""
    newest = await _settle(conn)
    if position is None:
        position = newest
    elif position > newest:
        raise PositionBeyondLog(f"position {position} is beyond the newest event's ({newest})")
    archived = Archived.read(archives, position) if archives else NOTHING_ARCHIVED
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        return await _digest_at(conn, position, progress, batch, archived)


async def verify_digest(
    conn: Connection,
    digest: Digest | str,
    progress: Callable[[int], None] | None = None,
    max_gaps: int = 10,
    archives: Sequence[ArchiveSource] = (),
) -> DigestReport:
    """Prove the log up to the digest's position unchanged: recompute the digest there and verify every
    stream's chain through the ``archives`` files (oldest first) and on into the live log, in one
    snapshot; ``progress`` gets the number of events verified so far. A position beyond the newest
    event is no error here: the log's tail may be what was removed."""
    expected = Digest.parse(digest) if isinstance(digest, str) else digest
    await _settle(conn)
    archived = Archived.read(archives, expected.position) if archives else NOTHING_ARCHIVED
    walk = ChainWalk()
    broken = None
    for source in archives:
        if (broken := walk_archive(source, walk, progress)) is not None:
            break
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        actual = await _digest_at(conn, expected.position, None, 10_000, archived)
        chains = walk.report(broken) if broken is not None else await verify_chains(conn, progress, walk=walk)
        gaps: list[tuple[int, int]] = []
        if actual != expected or not chains.ok:
            rows = await conn.fetch(GAPS_SQL, expected.position, max_gaps, archived.last_position)
            gaps = [(row["first"], row["last"]) for row in rows]
    return DigestReport(expected, actual, chains, gaps)


async def _settle(conn: Connection, timeout_s: float = 5.0) -> int:
    """The newest position, once the transactions running when it was read have ended (or ``timeout_s``
    passed: one still open then is taken to append nothing at or before it)."""
    row = await conn.fetchrow(NEWEST_SQL)
    assert row is not None
    deadline = time.monotonic() + timeout_s
    while row["running"] and time.monotonic() < deadline:
        if await conn.fetchval(STILL_RUNNING_SQL, row["running"]) == 0:
            break
        await asyncio.sleep(0.05)
    return int(row["newest"])


async def _digest_at(
    conn: Connection,
    position: int,
    progress: Callable[[int], None] | None,
    batch: int,
    archived: Archived = NOTHING_ARCHIVED,
) -> Digest:
    """The digest at ``position``, in the caller's transaction (a cursor needs one). Without archives
    the heads stream through a cursor; with them, the live heads are merged into the archived ones
    (a stream's live events come after its archived ones) and sorted in memory, one entry per stream."""
    events = archived.events + int(await conn.fetchval(COUNT_SQL, position))
    sha = hashlib.sha256(f"{PREFIX}\n{position}\n{events}\n".encode())
    streams = 0

    def hash_head(stream: str, version: int, at: int, chain_hash: bytes) -> None:
        nonlocal streams
        sha.update(json.dumps([stream, version, at, chain_hash.hex()]).encode() + b"\n")
        streams += 1
        if progress is not None and streams % batch == 0:
            progress(streams)

    if not archived.heads:
        async for row in conn.cursor(HEADS_SQL, position, prefetch=batch):
            hash_head(row["stream_id"], row["stream_version"], row["position"], bytes(row["hash"]))
    else:
        heads = dict(archived.heads)
        async for row in conn.cursor(HEADS_SQL, position, prefetch=batch):
            heads[row["stream_id"]] = (row["stream_version"], row["position"], bytes(row["hash"]))
        for stream, (version, at, chain_hash) in sorted(heads.items(), key=lambda item: item[1][1]):
            hash_head(stream, version, at, chain_hash)
    sha.update(f"{streams}\n".encode())
    return Digest(position, events, streams, sha.hexdigest())
