"""Archiving whole partitions to files and restoring them (eventstore/archive.py, `lockledger archive`).

Each test works on a database of its own holding a partition of January 2020: events appended there
(by the schema's owner, who may name their instant), then more events of the same streams now, so every
stream's chain runs from the old partition into the live log.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest
import zstandard
from typer.testing import CliRunner

from api.cli import app as cli
from eventstore.archive import (
    MIGRATOR_ROLE,
    ArchiveError,
    archive_before,
    catalog,
    partitions,
    restore_archive,
)
from eventstore.archive_file import ArchiveCorrupt, ArchiveSource, walk_archive
from eventstore.dburl import asyncpg_dsn
from eventstore.digest import compute_digest, verify_digest
from eventstore.verify import ChainWalk, verify_chains
from service.config import Settings
from service.retention import Retention
from tests.servers import running_server

pytestmark = pytest.mark.storage

JANUARY = datetime(2020, 1, 1, tzinfo=UTC)
FEBRUARY = datetime(2020, 2, 1, tzinfo=UTC)
OLD = "events_p20200101"
STREAMS = {"archive:a": 3, "archive:b": 1, "archive:c": 2}  # versions in January; each gets 2 more now

APPEND_SQL = """
INSERT INTO events (stream_id, stream_version, event_type, data, recorded_at)
VALUES ($1, $2, CASE WHEN $2::bigint = 1 THEN 'LOCK_ACQUIRED' ELSE 'LOCK_RENEWED' END, $3::jsonb, $4)
"""


async def _history(conn: asyncpg.Connection) -> None:
    await conn.execute(f"SET ROLE {MIGRATOR_ROLE}")  # the owner of every partition, as the reaper makes them
    await conn.execute(f"CREATE TABLE {OLD} (LIKE events INCLUDING DEFAULTS)")
    for trigger, when in (("events_append_only", "UPDATE OR DELETE"), ("events_no_truncate", "TRUNCATE")):
        await conn.execute(
            f"CREATE TRIGGER {trigger} BEFORE {when} ON {OLD} FOR EACH STATEMENT"
            " EXECUTE FUNCTION events_refuse_change()"
        )
    await conn.execute(
        f"ALTER TABLE events ATTACH PARTITION {OLD} FOR VALUES FROM ('{JANUARY.isoformat()}')"
        f" TO ('{FEBRUARY.isoformat()}')"
    )
    now = datetime.now(UTC) - timedelta(seconds=10)
    for n, (stream, versions) in enumerate(STREAMS.items()):
        for version in range(1, versions + 3):  # the first ones in January, two more now
            at = JANUARY + timedelta(days=3 + n, minutes=version) if version <= versions else now
            await conn.execute(APPEND_SQL, stream, version, _grant(at), at)


def _grant(at: datetime) -> str:
    deadline = (at + timedelta(seconds=30)).isoformat()
    return json.dumps({"owner": "agv-1", "fencing_token": 1, "expires_at": deadline})


@pytest.fixture
async def url(scratch_database_url: str) -> str:
    conn = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    try:
        await _history(conn)
    finally:
        await conn.close()
    return scratch_database_url


@pytest.fixture
async def migrator(url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(url), server_settings={"role": MIGRATOR_ROLE, "timezone": "UTC"})
    yield conn
    await conn.close()


async def _count(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM events"))


async def test_a_partition_goes_to_a_file_and_the_chains_run_through_it(
    migrator: asyncpg.Connection, tmp_path: Path
) -> None:
    digest = await compute_digest(migrator)
    before = await _count(migrator)
    january = sum(STREAMS.values())

    done = await archive_before(migrator, FEBRUARY, tmp_path)

    assert [r.partition for r in done] == [OLD]
    record = done[0]
    assert (record.events, record.start, record.end) == (january, JANUARY, FEBRUARY)
    assert (tmp_path / record.file_name).exists()
    assert OLD not in [p.name for p in await partitions(migrator)]
    assert await _count(migrator) == before - january
    assert [r.partition for r in await catalog(migrator) if r.archived] == [OLD]

    source = ArchiveSource(tmp_path / record.file_name, record.content_sha256)
    walk = ChainWalk()
    assert walk_archive(source, walk) is None
    report = await verify_chains(migrator, walk=walk)
    assert report.ok
    assert report.events == before
    assert report.streams == len(STREAMS)

    # Without the files, the live log's chains are checked from each stream's first live event.
    alone = await verify_chains(migrator, walk=ChainWalk(anchor=True))
    assert alone.ok
    assert alone.anchored == len(STREAMS)
    assert not (await verify_chains(migrator)).ok  # and a walk that does not know is told what is missing

    # The digest taken before the archive still verifies, counting the archived events from the file.
    assert await compute_digest(migrator, digest.position, archives=[source]) == digest
    assert (await verify_digest(migrator, digest, archives=[source])).ok
    assert not (await verify_digest(migrator, digest)).ok


async def test_nothing_is_archived_before_its_range_has_ended(
    migrator: asyncpg.Connection, tmp_path: Path
) -> None:
    now = datetime.now(UTC)
    done = await archive_before(migrator, now + timedelta(days=400), tmp_path)
    assert [r.partition for r in done] == [OLD]  # the live partitions' ranges have not ended
    assert all(p.end > now - timedelta(minutes=1) for p in await partitions(migrator))


async def test_a_restored_partition_is_the_one_archived(migrator: asyncpg.Connection, tmp_path: Path) -> None:
    digest = await compute_digest(migrator)
    before = await _count(migrator)
    (record,) = await archive_before(migrator, FEBRUARY, tmp_path)

    restored = await restore_archive(migrator, tmp_path / record.file_name)

    assert restored.restored_at is not None
    assert not restored.archived
    assert OLD in [p.name for p in await partitions(migrator)]
    assert await _count(migrator) == before
    assert (await verify_chains(migrator)).ok
    assert await compute_digest(migrator, digest.position) == digest
    # Append-only holds on the restored partition too.
    with pytest.raises(asyncpg.PostgresError, match="append-only"):
        await migrator.execute(f"DELETE FROM {OLD}")
    # And it can be archived again, to the same content.
    (again,) = await archive_before(migrator, FEBRUARY, tmp_path)
    assert again.content_sha256 == record.content_sha256


async def test_an_altered_file_is_not_restored(migrator: asyncpg.Connection, tmp_path: Path) -> None:
    (record,) = await archive_before(migrator, FEBRUARY, tmp_path)
    path = tmp_path / record.file_name
    lines = zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read().splitlines(keepends=True)
    event = json.loads(lines[1])
    event["data"] = event["data"].replace("agv-1", "agv-2")
    lines[1] = json.dumps(event).encode() + b"\n"
    path.write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines)))

    with pytest.raises(ArchiveCorrupt, match="altered"):
        await restore_archive(migrator, path)
    assert OLD not in [p.name for p in await partitions(migrator)]
    assert (await catalog(migrator))[0].archived

    other = tmp_path / "other.ndjson.zst"
    renamed = b"".join(lines).replace(OLD.encode(), b"events_p19990101")
    other.write_bytes(zstandard.ZstdCompressor().compress(renamed))
    with pytest.raises(ArchiveError, match="never archived"):
        await restore_archive(migrator, other)


async def test_replay_at_an_archived_instant_names_the_file(
    url: str, migrator: asyncpg.Connection, tmp_path: Path
) -> None:
    (record,) = await archive_before(migrator, FEBRUARY, tmp_path)
    with running_server(url, {"LOCKLEDGER_REAPER_ENABLED": "false"}) as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            answer = await http.get("/v1/replay/state", params={"at": "2020-01-05T00:00:00Z"})
            assert answer.status_code == 410, answer.text
            problem = answer.json()
            assert problem["code"] == "archived"
            assert problem["archives"][0]["file"] == record.file_name
            assert problem["archives"][0]["restore"] == f"lockledger restore {record.file_name}"
            history = await http.get("/v1/locks/archive:a/history", params={"from": "2020-01-01T00:00:00Z"})
            assert history.status_code == 410
            export = await http.get(
                "/v1/events", params={"from": "2020-01-20T00:00:00Z", "to": "2020-03-01T00:00:00Z"}
            )
            assert export.status_code == 410
            live = await http.get("/v1/locks/archive:a/history")
            assert live.status_code == 200
            assert live.headers["lockledger-live-since"].startswith("2020-02-01T00:00:00")
            assert [e["version"] for e in live.json()["events"]] == [4, 5]
            now = await http.get("/v1/replay/state", params={"at": datetime.now(UTC).isoformat()})
            assert now.status_code == 200
            assert [lease["resource"] for lease in now.json()["locks"]] == sorted(STREAMS)


def test_the_commands_archive_verify_and_restore(url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    archived = runner.invoke(
        cli, ["archive", "--before", "2020-02-01", "--dir", str(tmp_path), "--database-url", url]
    )
    assert archived.exit_code == 0, archived.output
    file_name, sha = archived.stdout.split()
    assert file_name == f"{OLD}.ndjson.zst"
    assert len(sha) == 64

    alone = runner.invoke(cli, ["verify", "--database-url", url])
    assert alone.exit_code == 0, alone.output
    assert "Pass --archives DIR" in alone.output
    spanning = runner.invoke(cli, ["verify", "--archives", str(tmp_path), "--database-url", url])
    assert spanning.exit_code == 0, spanning.output
    assert f"{sum(STREAMS.values()) + 2 * len(STREAMS)} events" in spanning.output.replace(",", "")

    (tmp_path / file_name).rename(tmp_path / "moved")
    missing = runner.invoke(cli, ["verify", "--archives", str(tmp_path), "--database-url", url])
    assert missing.exit_code == 1
    assert file_name in missing.output
    (tmp_path / "moved").rename(tmp_path / file_name)

    restored = runner.invoke(cli, ["restore", str(tmp_path / file_name), "--database-url", url])
    assert restored.exit_code == 0, restored.output
    again = runner.invoke(cli, ["restore", str(tmp_path / file_name), "--database-url", url])
    assert again.exit_code == 1
    assert "restored" in again.output


async def test_retention_archives_what_is_older_than_its_days(url: str, tmp_path: Path) -> None:
    settings = Settings(database_url=url, retention_days=30, archive_dir=str(tmp_path))
    done = await Retention(settings).run_once(now=FEBRUARY + timedelta(days=31))
    assert [r.partition for r in done] == [OLD]
    assert await Retention(settings).run_once(now=FEBRUARY + timedelta(days=31)) == []


async def test_a_server_with_retention_archives_on_its_own(url: str, tmp_path: Path) -> None:
    settings = {"LOCKLEDGER_RETENTION_DAYS": "30", "LOCKLEDGER_ARCHIVE_DIR": str(tmp_path)}
    with running_server(url, {"LOCKLEDGER_REAPER_ENABLED": "false", **settings}) as server:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            for _ in range(300):  # the first pass runs at start; a bound, not a timing
                if any(r.archived for r in await catalog(conn)):
                    break
                await asyncio.sleep(0.1)
            (record,) = await catalog(conn)
        finally:
            await conn.close()
        assert record.partition == OLD
        assert (tmp_path / record.file_name).exists()
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            metrics = (await http.get("/metrics")).text
        assert "lockledger_partitions_archived_total 1.0" in metrics
        assert f"lockledger_events_archived_total {float(sum(STREAMS.values()))}" in metrics


def test_a_user_who_cannot_become_the_migrator_is_told_so(url: str, tmp_path: Path) -> None:
    name = f"ll_nobody_{uuid.uuid4().hex[:8]}"

    async def admin(sql: str) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return await conn.fetch(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f"CREATE ROLE {name} LOGIN"))
    try:
        stranger = re.sub(r"//[^@/]*@", f"//{name}@", url, count=1)
        refused = CliRunner().invoke(
            cli, ["archive", "--before", "2020-02-01", "--dir", str(tmp_path), "--database-url", stranger]
        )
        assert refused.exit_code == 1, refused.output
        assert f"cannot SET ROLE {MIGRATOR_ROLE}" in refused.output
        kept = asyncio.run(admin(f"SELECT 1 FROM pg_class WHERE relname = '{OLD}'"))
        assert len(kept) == 1
    finally:
        asyncio.run(admin(f"DROP ROLE IF EXISTS {name}"))
