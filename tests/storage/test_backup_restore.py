"""The backup procedure of docs/operations.md, run for real: a base backup (``pg_basebackup``) plus the
WAL archive restores every acknowledged event with its hash chain intact, and a point-in-time restore
stops where it is told to.

It runs on an embedded PostgreSQL of its own (archiving needs a restart, and a server-wide setting is no
business of the suite's shared server), so it is skipped when the run's database is an external one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg
import pytest

from domain.commands import Acquire, Release, Renew
from eventstore import embedded
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import verify_chains
from migrations.upgrade import upgrade
from service.composition import lock_service_on_pool
from service.config import Settings
from service.database import create_pool
from service.lock_service import CommandContext
from tests import replica
from tests.assertions import granted
from tests.databases import TEST_DATABASE_URL_ENV

pytestmark = [pytest.mark.storage, pytest.mark.slow]

CTX = CommandContext()
TTL_MS = 60_000
ARCHIVE_TIMEOUT_S = 30.0
RECOVERY_TIMEOUT_S = 30.0

# What the embedded server keeps in its data directory while it runs (socket lock, holders' pids).
EMBEDDED_RUNTIME_FILES = (".s.PGSQL.*", ".handle_pids.json")

# stream -> (events, last stream_version, last position)
Snapshot = dict[str, tuple[int, int, int]]


@pytest.fixture
def scratch() -> Iterator[tuple[Path, replica.Programs]]:
    """A directory the PostgreSQL user owns, and the shipped PostgreSQL programs run as that user."""
    if os.environ.get(TEST_DATABASE_URL_ENV):
        pytest.skip("runs on an embedded server of its own; this run's database is an external server")
    bin_dir = replica.binaries()
    if bin_dir is None:
        pytest.skip("the embedded PostgreSQL binaries (with pg_basebackup) are not installed")
    directory = Path(tempfile.mkdtemp(prefix="lockledger-backup-"))
    user = replica.ROOT_RUNS_AS if os.geteuid() == 0 else None
    programs = replica.Programs(bin_dir, user, directory / "commands.log")
    try:
        programs.own(directory)
        yield directory, programs
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def server_on(data_dir: Path) -> Iterator[embedded.EmbeddedPostgres]:
    """The embedded server on ``data_dir``, stopped when the block ends."""
    server = embedded.start(data_dir)
    try:
        yield server
    finally:
        server.stop()


async def sql(url: str, statement: str) -> object:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await conn.fetchval(statement)
    finally:
        await conn.close()


async def write_batch(url: str, resources: list[str], owner: str) -> list[int]:
    """Acquire, renew and release each resource through the service; the fencing tokens it granted."""
    pool = await create_pool(Settings(database_url=url, reaper_enabled=False))
    try:
        service = lock_service_on_pool(pool, Settings().ttl_bounds)
        tokens = []
        for resource in resources:
            lease = granted(await service.execute(Acquire(resource, owner, TTL_MS), CTX))
            granted(await service.execute(Renew(resource, owner, lease.fencing_token), CTX))
            await service.execute(Release(resource, owner, lease.fencing_token), CTX)
            tokens.append(lease.fencing_token)
        await service.close()
        return tokens
    finally:
        await pool.close()


async def snapshot(url: str) -> Snapshot:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await conn.fetch(
            "SELECT stream_id, count(*) AS n, max(stream_version) AS version, max(position) AS position"
            " FROM events GROUP BY stream_id"
        )
    finally:
        await conn.close()
    return {r["stream_id"]: (r["n"], r["version"], r["position"]) for r in rows}


async def archive_current_wal(url: str) -> None:
    """Close the current WAL segment (``pg_switch_wal``) and wait until the archiver has copied it."""
    segment = await sql(url, "SELECT pg_walfile_name(pg_switch_wal())")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ARCHIVE_TIMEOUT_S
    while (archived := await sql(url, "SELECT last_archived_wal FROM pg_stat_archiver")) is None or str(
        archived
    ) < str(segment):
        assert loop.time() < deadline, f"{segment} was not archived (last: {archived})"
        await asyncio.sleep(0.1)


def restore_copy(backup: Path, target: Path, archive: Path, user: str | None, until: str | None) -> None:
    """The restore of docs/operations.md: a copy of the base backup that replays the archive (up to
    ``until``, then becomes a primary); archiving off, so the copy adds nothing to the archive. The
    embedded server keeps its socket's lock file and its holders' list in the data directory, so the
    backup has the primary's: they are left out of the copy."""
    shutil.copytree(backup, target, ignore=shutil.ignore_patterns(*EMBEDDED_RUNTIME_FILES))
    if user is not None:
        for root, dirs, files in os.walk(target):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                shutil.chown(name, user, user)
    target.chmod(0o700)
    settings = {"restore_command": f"cp {archive}/%f %p", "archive_mode": "off"}
    if until is not None:
        settings |= {"recovery_target_time": until, "recovery_target_action": "promote"}
    with (target / "postgresql.auto.conf").open("a") as conf:
        conf.writelines(f"{name} = '{value}'\n" for name, value in settings.items())
    (target / "recovery.signal").touch()


async def recovered(url: str) -> None:
    """Wait until the restored server has replayed what it will and accepts writes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RECOVERY_TIMEOUT_S
    while await sql(url, "SELECT pg_is_in_recovery()"):
        assert loop.time() < deadline, "the restored server is still recovering"
        await asyncio.sleep(0.1)


async def check_restored(url: str, expected: Snapshot, tokens: list[int]) -> None:
    assert await snapshot(url) == expected
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        report = await verify_chains(conn)
        granted_tokens = await conn.fetch(
            "SELECT (data->>'fencing_token')::bigint AS token FROM events WHERE event_type = 'LOCK_ACQUIRED'"
        )
    finally:
        await conn.close()
    assert report.ok, report.broken
    assert report.events == sum(n for n, _, _ in expected.values())
    assert sorted(r["token"] for r in granted_tokens) == sorted(tokens)


async def test_a_base_backup_and_the_wal_archive_restore_every_acknowledged_event(
    scratch: tuple[Path, replica.Programs],
) -> None:
    directory, programs = scratch
    archive = programs.own(directory / "archive")
    backup = directory / "base"
    primary_dir = directory / "primary"

    # Archiving is switched on as for any PostgreSQL: ALTER SYSTEM, then a restart.
    with server_on(primary_dir) as server:
        url = server.ensure_database()
        await sql(url, "ALTER SYSTEM SET archive_mode = 'on'")
        await sql(url, f"ALTER SYSTEM SET archive_command = 'test ! -f {archive}/%f && cp %p {archive}/%f'")
    with server_on(primary_dir) as server:
        url = server.ensure_database()
        assert await sql(url, "SHOW archive_mode") == "on"
        await asyncio.to_thread(upgrade, url)  # alembic runs its own event loop

        before_tokens = await write_batch(url, [f"dock-{i}" for i in range(5)], "agv-1")
        programs.run("pg_basebackup", "-D", str(backup), "-d", asyncpg_dsn(url), "-X", "stream", "-c", "fast")
        first_tokens = before_tokens + await write_batch(url, [f"dock-{i}" for i in range(3, 6)], "agv-2")
        first = await snapshot(url)
        between = str(await sql(url, "SELECT clock_timestamp()::text"))
        second_tokens = await write_batch(url, [f"dock-{i}" for i in range(4, 9)], "agv-3")
        second = await snapshot(url)
        await archive_current_wal(url)

    # Each batch added events, to streams old and new; the first batch's second half is after the base
    # backup, so only the archive has it.
    assert first != second
    restore_copy(backup, directory / "restored", archive, programs.user, until=None)
    with server_on(directory / "restored") as restored:
        url = restored.url(embedded.DATABASE)
        await recovered(url)
        await check_restored(url, second, first_tokens + second_tokens)

    restore_copy(backup, directory / "until", archive, programs.user, until=between)
    with server_on(directory / "until") as restored:
        url = restored.url(embedded.DATABASE)
        await recovered(url)
        await check_restored(url, first, first_tokens)
