"""Archive files: what is written is read back exactly, and a file altered afterwards is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from eventstore.archive_file import (
    FORMAT,
    ArchiveCorrupt,
    ArchivedEvent,
    ArchiveHeader,
    ArchiveReader,
    ArchiveWriter,
)
from eventstore.verify import BrokenLink, ChainWalk, event_hash

START = datetime(2026, 1, 1, tzinfo=UTC)
HEADER = ArchiveHeader("events_p20260101", START, START + timedelta(days=1))


def chained(streams: dict[str, int], first_position: int = 1) -> list[ArchivedEvent]:
    """Events of each stream (versions 1..n) with real chain hashes, in (stream, version) order."""
    events, position = [], first_position
    for stream, count in sorted(streams.items()):
        previous = b""
        for version in range(1, count + 1):
            at = START + timedelta(seconds=version)
            data, metadata = json.dumps({"owner": "agent-7", "n": version}), "{}"
            event_id = f"00000000-0000-7000-8000-{position:012d}"
            digest = event_hash(previous, stream, version, event_id, "LOCK_RENEWED", data, metadata, at)
            events.append(
                ArchivedEvent(
                    position, stream, version, event_id, "LOCK_RENEWED", data, metadata, at, 7, digest
                )
            )
            previous, position = digest, position + 1
    return events


def write(path: Path, events: list[ArchivedEvent]) -> str:
    writer = ArchiveWriter(path, HEADER)
    for event in events:
        writer.write(event)
    return writer.finish().content_sha256


def read(path: Path) -> tuple[list[ArchivedEvent], ArchiveReader]:
    with ArchiveReader(path) as reader:
        return list(reader), reader


def step(walk: ChainWalk, e: ArchivedEvent) -> BrokenLink | None:
    return walk.step(
        e.stream_id, e.stream_version, e.event_id, e.event_type, e.data, e.metadata, e.recorded_at, e.hash
    )


Row = tuple[str, int, str, datetime, bytes]
texts = st.text(st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            texts,
            st.integers(1, 2**62),
            texts,
            st.datetimes(timezones=st.just(UTC)),
            st.binary(min_size=32, max_size=32),
        ),
        max_size=20,
    )
)
def test_what_is_written_is_read_back_exactly(
    tmp_path_factory: pytest.TempPathFactory, rows: list[Row]
) -> None:
    events = [
        ArchivedEvent(i + 1, stream or "s", version, "id", "T", json.dumps(text), "{}", at, 1, digest)
        for i, (stream, version, text, at, digest) in enumerate(rows)
    ]
    path = tmp_path_factory.mktemp("archive") / "a.llarchive.zst"
    sha = write(path, events)
    read_back, reader = read(path)
    assert read_back == events
    assert reader.header == HEADER
    assert reader.trailer is not None
    assert reader.trailer.content_sha256 == sha
    assert reader.trailer.events == len(events)
    assert reader.trailer.first_position == (1 if events else None)


def test_the_trailer_names_each_streams_last_version_and_hash(tmp_path: Path) -> None:
    events = chained({"zone:A": 3, "zone:B": 2})
    write(tmp_path / "a", events)
    _, reader = read(tmp_path / "a")
    assert reader.trailer is not None
    assert reader.trailer.heads == {"zone:A": (3, events[2].hash), "zone:B": (2, events[4].hash)}
    assert (reader.trailer.first_position, reader.trailer.last_position) == (1, 5)


def test_a_chain_walk_goes_on_from_one_archive_into_the_next(tmp_path: Path) -> None:
    events = chained({"zone:A": 5})
    write(tmp_path / "old", events[:3])
    write(tmp_path / "new", events[3:])
    walk = ChainWalk()
    for name in ("old", "new"):
        with ArchiveReader(tmp_path / name) as reader:
            for e in reader:
                link = walk.step(
                    e.stream_id,
                    e.stream_version,
                    e.event_id,
                    e.event_type,
                    e.data,
                    e.metadata,
                    e.recorded_at,
                    e.hash,
                )
                assert link is None
        walk.end_source()
    assert (walk.events, walk.streams) == (5, 1)
    assert walk.heads["zone:A"] == (5, events[4].hash)


def test_a_chain_walk_without_the_older_archive_names_the_missing_version(tmp_path: Path) -> None:
    events = chained({"zone:A": 5})
    walk = ChainWalk()
    e = events[3]
    link = step(walk, e)
    assert link is not None
    assert (link.stream_id, link.version, link.reason) == ("zone:A", 1, "version 1 is missing")


def _rewrite(path: Path, edit: Callable[[list[bytes]], list[bytes]]) -> None:
    lines = zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read().splitlines(keepends=True)
    path.write_bytes(zstandard.ZstdCompressor().compress(b"".join(edit(lines))))


def _forge(lines: list[bytes]) -> list[bytes]:
    event = json.loads(lines[2])
    event["data"] = event["data"].replace("agent-7", "agent-8")
    return [lines[0], lines[1], json.dumps(event).encode() + b"\n", *lines[3:]]


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (_forge, "does not match its trailer"),
        (lambda lines: lines[:-1], "truncated"),
        (lambda lines: [lines[0], *lines[2:]], "does not match its trailer"),
        (lambda lines: [*lines, lines[1]], "after the trailer"),
        (lambda lines: [lines[0], b"not json\n", *lines[2:]], "not JSON"),
    ],
    ids=["an event edited", "the trailer cut off", "an event removed", "a line appended", "garbage"],
)
def test_a_file_altered_after_it_was_written_is_refused_by_name(
    tmp_path: Path, edit: Callable[[list[bytes]], list[bytes]], complaint: str
) -> None:
    path = tmp_path / "a.llarchive.zst"
    write(path, chained({"zone:A": 3}))
    _rewrite(path, edit)
    with pytest.raises(ArchiveCorrupt, match=complaint) as refused:
        read(path)
    assert str(path) in str(refused.value)


def test_a_file_of_another_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(b'{"format": "something-else"}\n'))
    with pytest.raises(ArchiveCorrupt, match=FORMAT):
        ArchiveReader(path)
    path.write_bytes(b"plain text, not zstd")
    with pytest.raises(ArchiveCorrupt, match="zstd"):
        ArchiveReader(path)


def test_an_abandoned_archive_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "a.llarchive.zst"
    writer = ArchiveWriter(path, HEADER)
    writer.write(chained({"zone:A": 1})[0])
    assert not path.exists()  # nothing under the final name before finish()
    writer.abandon()
    assert list(tmp_path.iterdir()) == []
