"""The bench's throwaway cluster gets its WAL segments before the first cell, so no commit in a cell waits
for a backend writing a new 16 MB segment of zeros (bench/database.py ``prepare_wal``).

It runs on an embedded cluster of its own, fresh as the bench's, never on a shared server: it changes
``min_wal_size`` with ALTER SYSTEM. PostgreSQL 18's ``pg_stat_io`` counts the segments made as WAL
writes in the ``init`` context, which is what is checked."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from bench.database import prepare_wal, provision
from eventstore import embedded
from eventstore.dburl import asyncpg_dsn
from eventstore.embedded import start

pytestmark = [pytest.mark.postgres, pytest.mark.slow]  # an embedded cluster of its own


@pytest.fixture(scope="module")
def fresh_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start(tmp_path_factory.mktemp("wal") / "pgdata", delete_on_stop=True)
    try:
        yield server.ensure_database("wal_ready")
    finally:
        server.stop()


async def _segments_made_by(conn: asyncpg.Connection, wal_segments: int) -> int:
    """How many segments this connection's commits made while filling ``wal_segments`` segments' worth."""
    made = (
        "SELECT coalesce(sum(writes), 0) FROM pg_stat_io"
        " WHERE object = 'wal' AND context = 'init' AND backend_type = 'client backend'"
    )
    before = await conn.fetchval(made)
    for _ in range(wal_segments * 16):
        await conn.execute("SELECT pg_logical_emit_message(true, 'wal-test', repeat('x', $1::int))", 2**20)
    await conn.execute("SELECT pg_stat_force_next_flush()")  # flushed when the backend next goes idle
    return int(await conn.fetchval(made) - before)


def test_a_prepared_cluster_commits_without_making_segments(fresh_cluster_url: str) -> None:
    async def scenario() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(fresh_cluster_url))
        try:
            if int(await conn.fetchval("SHOW server_version_num")) < 180000:
                pytest.skip("pg_stat_io counts WAL writes from PostgreSQL 18 on")
            # The control: on a fresh cluster, commits make the segments they cross into.
            assert await _segments_made_by(conn, 3) >= 2

            prepared = await prepare_wal(fresh_cluster_url, segments=8)
            assert prepared["segments"] == 8
            assert await conn.fetchval("SHOW min_wal_size") == "128MB"
            assert await conn.fetchval("SELECT count(*) FROM pg_ls_waldir()") >= 8

            assert await _segments_made_by(conn, 5) == 0
        finally:
            await conn.close()

    asyncio.run(scenario())


def test_the_bench_cluster_leaves_no_directory_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``provision`` makes a temporary directory for the embedded cluster's pgdata; ``close`` removes the
    directory itself, not only the pgdata the embedded server deletes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    database = provision(None)
    try:
        made = list(tmp_path.glob("lockledger-bench-*"))
        assert len(made) == 1
        assert (made[0] / "pgdata").is_dir()
        assert database.info["database"] == "embedded"
    finally:
        database.close()
    assert list(tmp_path.iterdir()) == []


def test_a_cluster_that_fails_to_start_leaves_no_directory_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("initdb failed")

    monkeypatch.setattr(embedded, "start", refuse)
    with pytest.raises(RuntimeError, match="initdb failed"):
        provision(None)
    assert list(tmp_path.iterdir()) == []
