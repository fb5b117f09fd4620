"""The events table partitioned by time (migration 0010): append-only on every partition, versions
unique across partitions, partitions made ahead, the default partition as the safety net, and the
conversion of a populated log with its positions, hashes and digest unchanged."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from alembic import command

from domain.commands import Acquire, Release, Renew
from eventstore.dburl import asyncpg_dsn
from eventstore.digest import compute_digest, verify_digest
from eventstore.verify import verify_chains
from migrations.upgrade import alembic_config, upgrade
from service.composition import lock_service_on_pool, reaper_on_pool
from service.config import Settings
from service.database import create_pool
from service.lock_service import CommandContext
from service.outcomes import Granted

pytestmark = pytest.mark.storage

INSERT_SQL = (
    "INSERT INTO events (stream_id, stream_version, event_type, data, recorded_at)"
    " VALUES ($1, $2, 'LOCK_RELEASED', '{}'::jsonb, $3) RETURNING tableoid::regclass::text AS partition"
)


async def _attempt(conn: asyncpg.Connection, sql: str, *args: Any) -> BaseException | None:
    """Run ``sql`` in a transaction that is always rolled back; the error it raised, if any."""
    try:
        async with conn.transaction():
            await conn.execute(sql, *args)
            raise _Rollback
    except _Rollback:
        return None
    except asyncpg.PostgresError as error:
        return error


class _Rollback(Exception):
    pass


async def _partitions(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    """Every partition of events with its bounds (NULL for the default), in order of the lower bound."""
    return await conn.fetch(
        "SELECT c.relname AS name, pg_get_userbyid(c.relowner) AS owner,"
        "       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''([^'']+)''\\)')::timestamptz"
        "         AS lower_bound,"
        "       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \\(''([^'']+)''\\)')::timestamptz"
        "         AS upper_bound"
        "  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'events'::regclass ORDER BY 3 NULLS LAST"
    )


@pytest.fixture
async def admin(scratch_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    yield conn
    await conn.close()


@pytest.fixture
async def service(scratch_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    await conn.execute("SET ROLE lockledger_service")
    yield conn
    await conn.close()


@pytest.mark.parametrize(
    ("statement", "operation"),
    [
        ("UPDATE {} SET event_type = event_type", "UPDATE"),
        ("DELETE FROM {} WHERE false", "DELETE"),
        ("TRUNCATE {}", "TRUNCATE"),
    ],
)
async def test_every_partition_refuses_changes_even_to_the_owner(
    admin: asyncpg.Connection, statement: str, operation: str
) -> None:
    await admin.fetchval("SELECT events_create_partitions('day', 2)")
    names = [row["name"] for row in await _partitions(admin)]
    assert "events_default" in names
    assert len(names) >= 4
    for name in ["events", *names]:
        error = await _attempt(admin, statement.format(name))
        assert isinstance(error, asyncpg.PostgresError), name
        assert f"append-only: {operation} refused" in str(error), name


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE {} SET event_type = event_type",
        "DELETE FROM {} WHERE false",
        "TRUNCATE {}",
        "INSERT INTO {} (stream_id, stream_version, event_type, data) VALUES ('x', 1, 't', '{{}}'::jsonb)",
        "SELECT count(*) FROM {}",
    ],
)
async def test_the_service_role_reaches_partitions_only_through_events(
    admin: asyncpg.Connection, service: asyncpg.Connection, statement: str
) -> None:
    for name in [row["name"] for row in await _partitions(admin)]:
        error = await _attempt(service, statement.format(name))
        assert isinstance(error, asyncpg.InsufficientPrivilegeError), name


async def test_the_service_role_may_not_move_a_stream_head(service: asyncpg.Connection) -> None:
    error = await _attempt(service, "UPDATE stream_heads SET version = 1")
    assert isinstance(error, asyncpg.InsufficientPrivilegeError)
    error = await _attempt(service, "INSERT INTO stream_heads VALUES ('x', 7, ''::bytea)")
    assert isinstance(error, asyncpg.InsufficientPrivilegeError)


async def test_partitions_are_created_ahead_contiguous_and_droppable_by_the_migrator(
    admin: asyncpg.Connection, service: asyncpg.Connection
) -> None:
    # The migration made today's and tomorrow's.
    assert await service.fetchval("SELECT events_create_partitions('day', 3)") >= 2
    assert await service.fetchval("SELECT events_create_partitions('day', 3)") == 0
    # A change of interval continues from where the days end: a month at most, then whole months.
    assert await service.fetchval("SELECT events_create_partitions('month', 2)") >= 2
    now = await admin.fetchval("SELECT clock_timestamp()")
    ranges = [row for row in await _partitions(admin) if row["name"] != "events_default"]
    assert {row["owner"] for row in ranges} == {"lockledger_migrator"}
    for before, after in itertools.pairwise(ranges):
        assert before["upper_bound"] == after["lower_bound"]
        assert after["name"] == "events_p" + after["lower_bound"].strftime("%Y%m%d")
    assert ranges[0]["lower_bound"] <= now < ranges[0]["upper_bound"]
    assert ranges[-1]["upper_bound"] > now + timedelta(days=59)
    assert ranges[-1]["upper_bound"].day == 1
    last = ranges[-1]["name"]
    await admin.execute("SET ROLE lockledger_migrator")
    await admin.execute(f"ALTER TABLE events DETACH PARTITION {last}")
    await admin.execute(f"DROP TABLE {last}")
    await admin.execute("RESET ROLE")
    assert last not in [row["name"] for row in await _partitions(admin)]
    with pytest.raises(asyncpg.InvalidParameterValueError):
        await service.fetchval("SELECT events_create_partitions('week', 3)")


async def test_an_event_no_partition_covers_goes_to_the_default_and_its_range_stays_there(
    admin: asyncpg.Connection, service: asyncpg.Connection
) -> None:
    now = await admin.fetchval("SELECT clock_timestamp()")
    stream = f"far:{uuid.uuid4().hex[:8]}"
    assert await admin.fetchval(INSERT_SQL, stream, 1, now + timedelta(days=10)) == "events_default"
    # The day holding that event stays the default partition's; the days around it get their own.
    await service.execute("SET client_min_messages = warning")
    created = await service.fetchval("SELECT events_create_partitions('day', 12)")
    ranges = [row for row in await _partitions(admin) if row["name"] != "events_default"]
    covered = [row for row in ranges if row["lower_bound"] <= now + timedelta(days=10) < row["upper_bound"]]
    assert covered == []
    assert created >= 10
    assert ranges[-1]["upper_bound"] > now + timedelta(days=12)
    later = now + timedelta(days=10, seconds=1)
    assert await admin.fetchval(INSERT_SQL, stream, 2, later) == "events_default"
    assert (await admin.fetchval(INSERT_SQL, stream, 3, now + timedelta(days=11))).startswith("events_p")
    assert (await verify_chains(admin)).ok


async def test_a_stream_version_is_unique_across_partitions(admin: asyncpg.Connection) -> None:
    await admin.fetchval("SELECT events_create_partitions('day', 3)")
    now = await admin.fetchval("SELECT clock_timestamp()")
    stream = f"s:{uuid.uuid4().hex[:8]}"
    await admin.fetchval(INSERT_SQL, stream, 1, now)
    await admin.fetchval(INSERT_SQL, stream, 2, now)
    for version in (1, 2):
        error = await _attempt(admin, INSERT_SQL, stream, version, now + timedelta(days=2))
        assert isinstance(error, asyncpg.UniqueViolationError)
        assert error.constraint_name == "events_stream_version_key"
    error = await _attempt(admin, INSERT_SQL, stream, 4, now + timedelta(days=2))
    assert isinstance(error, asyncpg.ForeignKeyViolationError)
    assert await admin.fetchval("SELECT version FROM stream_heads WHERE stream_id = $1", stream) == 2


async def test_two_first_versions_at_once_one_wins(scratch_database_url: str) -> None:
    """The second creator of a stream waits for the first and then fails as a unique index would."""
    first = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    second = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    stream = f"race:{uuid.uuid4().hex[:8]}"
    try:
        insert = "INSERT INTO events (stream_id, stream_version, event_type, data) VALUES ($1, 1, 't', '{}')"
        first_tx = first.transaction()
        await first_tx.start()
        await first.execute(insert, stream)
        racing = asyncio.ensure_future(second.execute(insert, stream))
        await asyncio.sleep(0.2)
        assert not racing.done()
        await first_tx.commit()
        with pytest.raises(asyncpg.UniqueViolationError) as raised:
            await racing
        assert raised.value.constraint_name == "events_stream_version_key"
    finally:
        await first.close()
        await second.close()


@pytest.fixture
def database_at_0009(database_url: str) -> Iterator[str]:
    """A database of its own migrated to the revision before partitioning."""
    name = f"lockledger_convert_{uuid.uuid4().hex[:8]}"
    asyncio.run(_admin_sql(database_url, f'CREATE DATABASE "{name}"'))
    url = urlunsplit(urlsplit(database_url)._replace(path=f"/{name}"))
    upgrade(url, "0009")
    try:
        yield url
    finally:
        asyncio.run(_admin_sql(database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def _admin_sql(url: str, sql: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


# lock_state's columns from migrations 0014 and 0017, which today's commands write.
_LENT_COLUMNS = ("handed_off_by", "reservation_id")
# The commands of this tree read the fair queue (migration 0015), which a database at 0009 lacks: an
# empty stand-in while the old schema's history is written, dropped before the migrations run.
_QUEUE_STAND_IN = (
    "CREATE TABLE lock_queue (ticket bigint PRIMARY KEY, resource text, owner text, server text,"
    " since timestamptz, deadline timestamptz)",
    "GRANT SELECT, DELETE ON lock_queue TO lockledger_service",
    "CREATE FUNCTION lock_queue_ahead(text, bigint, timestamptz) RETURNS boolean LANGUAGE sql"
    " AS 'SELECT false'",
)
_NO_QUEUE_STAND_IN = ("DROP FUNCTION lock_queue_ahead(text, bigint, timestamptz)", "DROP TABLE lock_queue")


async def _history_at_0009(url: str, resources: int) -> None:
    """``_history`` on a database at 0009, through the queue's stand-in."""
    for sql in _QUEUE_STAND_IN:
        await _admin_sql(url, sql)
    try:
        await _history(url, resources)
    finally:
        for sql in _NO_QUEUE_STAND_IN:
            await _admin_sql(url, sql)


async def _history(url: str, resources: int) -> None:
    """Acquire, renew and release ``resources`` locks, then acquire and release them again: five events
    each, the locks free at the end. On a schema older than the command path's (0009), the lock_state
    columns it writes are lent for the while and taken back, so the schema is the old one again."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        present = await conn.fetch(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_name = 'lock_state' AND column_name = ANY($1::text[])",
            list(_LENT_COLUMNS),
        )
        lent = [column for column in _LENT_COLUMNS if column not in {row[0] for row in present}]
        for column in lent:
            await conn.execute(f"ALTER TABLE lock_state ADD COLUMN {column} text")
        await _commands(url, resources)
        for column in lent:
            await conn.execute(f"ALTER TABLE lock_state DROP COLUMN {column}")
    finally:
        await conn.close()


async def _commands(url: str, resources: int) -> None:
    settings = Settings(database_url=url, reaper_enabled=False)
    pool = await create_pool(settings)
    try:
        service = lock_service_on_pool(pool, settings.ttl_bounds)
        for n in range(resources):
            resource = f"conv:{n}"
            granted = (await service.execute(Acquire(resource, "bot", 30_000), CommandContext())).outcome
            assert isinstance(granted, Granted)
            await service.execute(Renew(resource, "bot", granted.fencing_token, 30_000), CommandContext())
            await service.execute(Release(resource, "bot", granted.fencing_token), CommandContext())
            again = (await service.execute(Acquire(resource, "bot2", 30_000), CommandContext())).outcome
            assert isinstance(again, Granted)
            await service.execute(Release(resource, "bot2", again.fencing_token), CommandContext())
    finally:
        await pool.close()


async def _log(url: str) -> tuple[list[tuple[Any, ...]], str, bool]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await conn.fetch(
            "SELECT position, stream_id, stream_version, event_id, recorded_at, tx_id::text, hash"
            " FROM events ORDER BY position"
        )
        digest = await compute_digest(conn)
        return [tuple(row) for row in rows], str(digest), (await verify_digest(conn, digest)).ok
    finally:
        await conn.close()


async def _digest_holds(url: str, digest: str) -> bool:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return (await verify_digest(conn, digest)).ok
    finally:
        await conn.close()


async def test_conversion_keeps_positions_hashes_and_the_digest_both_ways(database_at_0009: str) -> None:
    url = database_at_0009
    await _history_at_0009(url, 20)
    before, digest, ok = await _log(url)
    assert ok
    assert len(before) == 100

    await asyncio.to_thread(upgrade, url)  # alembic's env runs an event loop of its own
    after, digest_after, ok = await _log(url)
    assert ok
    assert (after, digest_after) == (before, digest)
    await _history(url, 5)  # positions go on after the old table's; the chains go on from its heads
    grown, _, ok = await _log(url)
    assert ok
    assert grown[: len(before)] == before
    assert grown[len(before)][0] > before[-1][0]
    assert await _digest_holds(url, digest)
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await conn.fetch("SELECT stream_id, version FROM stream_heads")
        heads = {row["stream_id"]: row["version"] for row in rows}
        assert heads == {f"conv:{n}": 10 if n < 5 else 5 for n in range(20)}
    finally:
        await conn.close()

    await asyncio.to_thread(command.downgrade, alembic_config(url), "0009")
    back, digest_back, ok = await _log(url)
    assert ok
    assert back == grown
    assert await _digest_holds(url, digest)
    await _history_at_0009(url, 2)
    again, _, ok = await _log(url)
    assert ok
    assert again[len(back)][0] > back[-1][0]
    assert await _digest_holds(url, digest_back)


async def test_a_reaper_pass_creates_the_partitions_ahead(
    scratch_database_url: str, admin: asyncpg.Connection
) -> None:
    settings = Settings(
        database_url=scratch_database_url, reaper_enabled=False, partition_interval="day", partitions_ahead=6
    )
    pool = await create_pool(settings)
    try:
        await reaper_on_pool(pool, settings).run_once()
    finally:
        await pool.close()
    now = await admin.fetchval("SELECT clock_timestamp()")
    ranges = [row for row in await _partitions(admin) if row["name"] != "events_default"]
    assert ranges[-1]["upper_bound"] > now + timedelta(days=6)
    assert ranges[-1]["upper_bound"] - ranges[-1]["lower_bound"] == timedelta(days=1)


async def test_creating_partitions_waits_for_no_append_in_flight(scratch_database_url: str) -> None:
    """ATTACH takes a lock appends do not hold against it (CREATE TABLE ... PARTITION OF would wait for
    the append's transaction, and every later append would queue behind it)."""
    appender = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    creator = await asyncpg.connect(asyncpg_dsn(scratch_database_url))
    try:
        in_flight = appender.transaction()
        await in_flight.start()
        await appender.execute(
            "INSERT INTO events (stream_id, stream_version, event_type, data) VALUES ($1, 1, 't', '{}')",
            f"busy:{uuid.uuid4().hex[:8]}",
        )
        await creator.execute("SET lock_timeout = '2s'")
        assert await creator.fetchval("SELECT events_create_partitions('day', 5)") >= 4
        await in_flight.commit()
    finally:
        await appender.close()
        await creator.close()
