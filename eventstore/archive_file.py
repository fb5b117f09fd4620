"""An archive file: the events of one old partition, compressed, self-describing, with its own digest.

The format is zstd-compressed NDJSON (decision 0046), readable decades from now with ``zstdcat | jq``
and queryable in place by DuckDB's ``read_ndjson``:

- line 1, the header: ``{"format": "lockledger-archive/1", "partition": ..., "from": ..., "to": ...,
  "columns": [...]}``;
- one line per event, in (stream, version) order, every column of ``events``; ``data`` and ``metadata``
  are the exact text PostgreSQL gave (``jsonb::text``), because the hash chain covers that text;
- the last line, the trailer: the event and stream counts, the first and last position, each stream's
  last version and hash in the file (``heads``: the live log's next event of the stream chains to it),
  and ``content_sha256``, the SHA-256 of every uncompressed byte before the trailer.

``content_sha256`` is the file's digest: the live database records it when the partition is archived,
and reading a file checks it, so a file edited after the fact is refused by name.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import zstandard

from eventstore.verify import BrokenLink, ChainWalk

FORMAT = "lockledger-archive/1"
COLUMNS = (
    "position",
    "stream_id",
    "stream_version",
    "event_id",
    "event_type",
    "data",
    "metadata",
    "recorded_at",
    "tx_id",
    "hash",
)
COMPRESSION_LEVEL = 3


class ArchiveCorrupt(ValueError):
    """A file that is not a whole, unaltered lockledger archive."""


@dataclass(frozen=True, slots=True)
class ArchivedEvent:
    """One row of ``events`` as an archive keeps it."""

    position: int
    stream_id: str
    stream_version: int
    event_id: str
    event_type: str
    data: str
    metadata: str
    recorded_at: datetime
    tx_id: int
    hash: bytes

    def line(self) -> bytes:
        return _line(
            {
                "position": self.position,
                "stream_id": self.stream_id,
                "stream_version": self.stream_version,
                "event_id": self.event_id,
                "event_type": self.event_type,
                "data": self.data,
                "metadata": self.metadata,
                "recorded_at": self.recorded_at.isoformat(timespec="microseconds"),
                "tx_id": self.tx_id,
                "hash": self.hash.hex(),
            }
        )

    @classmethod
    def parse(cls, fields: dict[str, Any]) -> ArchivedEvent:
        return cls(
            position=int(fields["position"]),
            stream_id=str(fields["stream_id"]),
            stream_version=int(fields["stream_version"]),
            event_id=str(fields["event_id"]),
            event_type=str(fields["event_type"]),
            data=str(fields["data"]),
            metadata=str(fields["metadata"]),
            recorded_at=datetime.fromisoformat(fields["recorded_at"]),
            tx_id=int(fields["tx_id"]),
            hash=bytes.fromhex(fields["hash"]),
        )


@dataclass(frozen=True, slots=True)
class ArchiveHeader:
    partition: str
    start: datetime  # the partition's bounds, [start, end)
    end: datetime

    def line(self) -> bytes:
        return _line(
            {
                "format": FORMAT,
                "partition": self.partition,
                "from": self.start.isoformat(),
                "to": self.end.isoformat(),
                "columns": list(COLUMNS),
            }
        )

    @classmethod
    def parse(cls, fields: dict[str, Any]) -> ArchiveHeader:
        if fields.get("format") != FORMAT:
            raise ArchiveCorrupt(f"not a {FORMAT} file (format {fields.get('format')!r})")
        start, end = datetime.fromisoformat(fields["from"]), datetime.fromisoformat(fields["to"])
        return cls(fields["partition"], start, end)


@dataclass(frozen=True, slots=True)
class ArchiveTrailer:
    events: int
    first_position: int | None
    last_position: int | None
    heads: dict[str, tuple[int, bytes]]  # each stream's last version and hash in the file
    content_sha256: str

    @property
    def streams(self) -> int:
        return len(self.heads)

    def line(self) -> bytes:
        return _line(
            {
                "trailer": True,
                "events": self.events,
                "streams": self.streams,
                "first_position": self.first_position,
                "last_position": self.last_position,
                "heads": {stream: [version, sha.hex()] for stream, (version, sha) in self.heads.items()},
                "content_sha256": self.content_sha256,
            }
        )

    @classmethod
    def parse(cls, fields: dict[str, Any]) -> ArchiveTrailer:
        heads = {name: (int(version), bytes.fromhex(sha)) for name, (version, sha) in fields["heads"].items()}
        return cls(
            int(fields["events"]),
            fields["first_position"],
            fields["last_position"],
            heads,
            str(fields["content_sha256"]),
        )


def _line(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class ArchiveWriter:
    """Write an archive file: the header at once, events in (stream, version) order, the trailer on
    :meth:`finish`. The file appears under its name only once finished and synced (written beside it,
    then renamed), so a crash leaves no half archive that looks whole."""

    def __init__(self, path: Path, header: ArchiveHeader) -> None:
        self.path = path
        self._partial = path.with_name(path.name + ".partial")
        self._raw = self._partial.open("wb")
        self._out = zstandard.ZstdCompressor(level=COMPRESSION_LEVEL).stream_writer(self._raw, closefd=False)
        self._sha = hashlib.sha256()
        self._heads: dict[str, tuple[int, bytes]] = {}
        self._events = 0
        self._first: int | None = None
        self._last: int | None = None
        self._write(header.line())

    def _write(self, line: bytes) -> None:
        self._sha.update(line)
        self._out.write(line)

    def write(self, event: ArchivedEvent) -> None:
        self._write(event.line())
        self._heads[event.stream_id] = (event.stream_version, event.hash)
        self._events += 1
        self._first = event.position if self._first is None else min(self._first, event.position)
        self._last = event.position if self._last is None else max(self._last, event.position)

    def finish(self) -> ArchiveTrailer:
        trailer = ArchiveTrailer(self._events, self._first, self._last, self._heads, self._sha.hexdigest())
        self._out.write(trailer.line())
        self._out.flush(zstandard.FLUSH_FRAME)  # ends the frame; the writer leaves the file open (closefd)
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        self._partial.replace(self.path)
        return trailer

    def abandon(self) -> None:
        """Give up: close and remove the partial file."""
        self._raw.close()
        self._partial.unlink(missing_ok=True)


class ArchiveReader:
    """Read an archive file: ``header`` at once, the events by iterating, ``trailer`` after the last
    event. Iterating to the end checks the event count and the content digest against the trailer and
    raises :class:`ArchiveCorrupt` naming the file when either differs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._raw = path.open("rb")
        self._text = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(self._raw))
        self._sha = hashlib.sha256()
        first = self._next_line()
        if first is None:
            raise ArchiveCorrupt(f"{path}: empty")
        self.header = ArchiveHeader.parse(self._decode(first))
        self._sha.update(first)
        self.trailer: ArchiveTrailer | None = None

    def _next_line(self) -> bytes | None:
        try:
            line = self._text.readline()
        except zstandard.ZstdError as error:
            raise ArchiveCorrupt(f"{self.path}: not readable as zstd: {error}") from error
        return line or None

    def _decode(self, line: bytes) -> dict[str, Any]:
        try:
            fields = json.loads(line)
        except ValueError as error:
            raise ArchiveCorrupt(f"{self.path}: a line is not JSON") from error
        if not isinstance(fields, dict):
            raise ArchiveCorrupt(f"{self.path}: a line is not a JSON object")
        return fields

    def __iter__(self) -> Iterator[ArchivedEvent]:
        count = 0
        while (line := self._next_line()) is not None:
            fields = self._decode(line)
            if fields.get("trailer") is True:
                trailer = ArchiveTrailer.parse(fields)
                if trailer.content_sha256 != self._sha.hexdigest() or trailer.events != count:
                    raise ArchiveCorrupt(
                        f"{self.path}: its content does not match its trailer (altered after it was written)"
                    )
                if self._next_line() is not None:
                    raise ArchiveCorrupt(f"{self.path}: lines after the trailer")
                self.trailer = trailer
                return
            self._sha.update(line)
            try:
                yield ArchivedEvent.parse(fields)
            except (KeyError, TypeError, ValueError) as error:
                raise ArchiveCorrupt(f"{self.path}: an event line lacks a column or has a bad value") from (
                    error
                )
            count += 1
        raise ArchiveCorrupt(f"{self.path}: truncated (no trailer)")

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class ArchiveSource:
    """An archive file to read, with the digest the archive catalog recorded for it (None: unchecked)."""

    path: Path
    content_sha256: str | None = None

    def open(self) -> ArchiveReader:
        return ArchiveReader(self.path)

    def check(self, reader: ArchiveReader) -> None:
        """After reading to the end: the file's digest is the recorded one."""
        assert reader.trailer is not None
        if self.content_sha256 is not None and reader.trailer.content_sha256 != self.content_sha256:
            raise ArchiveCorrupt(
                f"{self.path}: its digest {reader.trailer.content_sha256} is not the one recorded when it was"
                f" archived ({self.content_sha256})"
            )


def walk_archive(
    source: ArchiveSource, walk: ChainWalk, progress: Callable[[int], None] | None = None
) -> BrokenLink | None:
    """Carry ``walk`` through one archive file's events, checking the file's digest as it reads; the
    first broken link, or None. Archives are walked oldest first, then the live log."""
    with source.open() as reader:
        for event in reader:
            broken = walk.step(
                event.stream_id,
                event.stream_version,
                event.event_id,
                event.event_type,
                event.data,
                event.metadata,
                event.recorded_at,
                event.hash,
            )
            if broken is not None:
                return broken
            if progress is not None and walk.events % 10_000 == 0:
                progress(walk.events)
        source.check(reader)
    walk.end_source()
    return None
