"""The log digest (eventstore/digest.py): a value kept outside the system proves the log up to its position
unchanged, and names what a superuser's tampering changed.

Tampering needs a log of its own: each tamper test works on a fresh database on the test server, dropped
afterwards, since other tests verify the chains of the shared one. The rest reads the shared log.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from typer.testing import CliRunner

from api.cli import app as cli
from domain.access import Role
from domain.commands import Acquire, Release
from eventstore.dburl import asyncpg_dsn
from eventstore.digest import Digest, PositionBeyondLog, compute_digest, verify_digest
from migrations.upgrade import upgrade
from service.lock_service import CommandContext, LockService
from tests.assertions import assert_problem
from tests.databases import TestDatabase, replace_database
from tests.servers import IssueToken, ServerProcess

pytestmark = pytest.mark.storage

# The fresh log: three streams, and a position left empty by a transaction that rolled back.
STREAMS = {"digest:a": 3, "digest:b": 2, "digest:c": 3}


@pytest.fixture
async def fresh_url(test_database: TestDatabase) -> AsyncIterator[str]:
    """A migrated database of its own holding the STREAMS log; dropped after the test."""
    name = f"lockledger_digest_{uuid.uuid4().hex[:10]}"
    server = await asyncpg.connect(asyncpg_dsn(test_database.url))
    try:
        await server.execute(f'CREATE DATABASE "{name}"')
        url = replace_database(test_database.url, name)
        await asyncio.to_thread(upgrade, url)
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            await _fill(conn)
        finally:
            await conn.close()
        yield url
    finally:
        await server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await server.close()


async def _fill(conn: asyncpg.Connection) -> None:
    async def append(stream: str, version: int) -> None:
        await conn.execute(
            "INSERT INTO events (stream_id, stream_version, event_type, data) VALUES ($1, $2, 'NOTE', $3)",
            stream,
            version,
            f'{{"n": {version}}}',
        )

    for stream, versions in STREAMS.items():
        for version in range(1, versions + 1):
            await append(stream, version)
        if stream == "digest:a":
            tx = conn.transaction()
            await tx.start()
            await append("digest:rolled-back", 1)
            await tx.rollback()


async def _tamper(url: str, statement: str) -> None:
    """Run ``statement`` as the database's owner with the append-only triggers off, and commit it."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        async with conn.transaction():
            await conn.execute("ALTER TABLE events DISABLE TRIGGER USER")
            assert (await conn.execute(statement)).split()[-1] != "0"
            await conn.execute("ALTER TABLE events ENABLE TRIGGER USER")
    finally:
        await conn.close()


async def _digest(url: str) -> Digest:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await compute_digest(conn)
    finally:
        await conn.close()


async def _verify(url: str, digest: Digest) -> list[str]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        report = await verify_digest(conn, digest)
    finally:
        await conn.close()
    assert not report.ok
    return report.findings()


async def test_an_untouched_log_verifies(fresh_url: str) -> None:
    digest = await _digest(fresh_url)
    assert (digest.position, digest.events, digest.streams) == (9, 8, 3)  # position 4 rolled back
    assert Digest.parse(str(digest)) == digest
    conn = await asyncpg.connect(asyncpg_dsn(fresh_url))
    try:
        report = await verify_digest(conn, str(digest))
        assert await compute_digest(conn, 5) != digest
        with pytest.raises(PositionBeyondLog):
            await compute_digest(conn, 10)
    finally:
        await conn.close()
    assert report.ok, report.findings()
    assert report.findings() == []


async def test_an_altered_event_is_named_by_its_broken_link(fresh_url: str) -> None:
    digest = await _digest(fresh_url)
    await _tamper(
        fresh_url,
        """UPDATE events SET data = '{"n": 99}' WHERE stream_id = 'digest:a' AND stream_version = 2""",
    )
    findings = await _verify(fresh_url, digest)
    assert findings == ["broken chain: stream digest:a version 2: hash does not match the event's content"]


async def test_a_streams_removed_newest_event_is_detected_though_its_chain_is_valid(fresh_url: str) -> None:
    digest = await _digest(fresh_url)
    await _tamper(fresh_url, "DELETE FROM events WHERE stream_id = 'digest:b' AND stream_version = 2")
    findings = await _verify(fresh_url, digest)
    assert not any(f.startswith("broken chain") for f in findings)  # the shorter chain is a valid one
    assert "1 event(s) removed at or before position 9: the digest counted 8, the log now has 7" in findings
    gaps = [f for f in findings if "hold no event" in f]
    assert gaps == [
        "2 position(s) in 1..9 hold no event: 4, 6; 1 held none already when the digest was taken"
        " (a transaction that rolled back leaves a gap too)"
    ]
    assert any(f.startswith("the stream heads at position 9 differ") for f in findings)


async def test_a_removed_stream_fails_verify_digest_on_the_command_line(fresh_url: str) -> None:
    digest = await _digest(fresh_url)
    await _tamper(fresh_url, "DELETE FROM events WHERE stream_id = 'digest:c'")
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "api.cli", "verify", "--digest", str(digest), "--database-url", fresh_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert "CHANGED: the log up to position 9 differs" in done.stderr
    assert "3 event(s) removed at or before position 9" in done.stderr
    assert "1 whole stream(s) removed" in done.stderr
    assert "4 position(s) in 1..9 hold no event: 4, 7-9; 1 held none already" in done.stderr


def test_the_command_line_prints_the_digest_alone_and_verifies_it(fresh_url: str) -> None:
    runner = CliRunner()
    taken = runner.invoke(cli, ["audit", "digest", "--position", "5", "--database-url", fresh_url])
    assert taken.exit_code == 0, taken.output
    digest = Digest.parse(taken.stdout)
    assert taken.stdout == f"{digest}\n"
    assert (digest.position, digest.events, digest.streams) == (5, 4, 2)
    assert "up to position 5: 4 events in 2 streams" in taken.stderr
    verified = runner.invoke(cli, ["verify", "--digest", str(digest), "--database-url", fresh_url])
    assert verified.exit_code == 0, verified.output
    assert "OK: the log up to position 5 is unchanged" in verified.stderr
    beyond = runner.invoke(cli, ["audit", "digest", "--position", "10", "--database-url", fresh_url])
    assert beyond.exit_code == 2
    assert "position 10 is beyond the newest event's (9)" in beyond.stderr
    malformed = runner.invoke(cli, ["verify", "--digest", "lldg1:5:4", "--database-url", fresh_url])
    assert malformed.exit_code == 2
    assert "not a log digest" in malformed.stderr


async def test_a_digest_still_verifies_after_more_events_are_appended(
    admin_pool: asyncpg.Pool, lock_service: LockService, unique_prefix: str
) -> None:
    resource = f"{unique_prefix}digest"
    await lock_service.execute(Acquire(resource, "bot1", 30_000), CommandContext())
    async with admin_pool.acquire() as conn:
        digest = await compute_digest(conn)
    await lock_service.execute(Release(resource, "bot1", 1), CommandContext())
    await lock_service.execute(Acquire(resource, "bot2", 30_000), CommandContext())
    async with admin_pool.acquire() as conn:
        report = await verify_digest(conn, digest)
        later = await compute_digest(conn)
        again = await compute_digest(conn, digest.position)
    assert report.ok, report.findings()
    assert later.position >= digest.position + 2
    assert later.events >= digest.events + 2
    assert again == digest


async def test_the_endpoint_answers_an_investigator_and_refuses_an_agent(
    auth_server: ServerProcess, issue_token: IssueToken, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    investigator = await issue_token(f"{unique_prefix}investigator", Role.INVESTIGATOR)
    agent = await issue_token(f"{unique_prefix}agent", Role.AGENT)
    async with httpx.AsyncClient(base_url=auth_server.base_url, timeout=30.0) as api:
        answer = await api.get("/v1/audit/digest", headers={"Authorization": f"Bearer {investigator}"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        digest = Digest.parse(body["digest"])
        assert body == {
            "position": digest.position,
            "events": digest.events,
            "streams": digest.streams,
            "digest": str(digest),
        }
        async with admin_pool.acquire() as conn:
            assert (await verify_digest(conn, digest)).ok
        beyond = await api.get(
            "/v1/audit/digest",
            params={"position": digest.position + 1_000_000},
            headers={"Authorization": f"Bearer {investigator}"},
        )
        assert_problem(beyond, 404, "not_found")
        assert "beyond the newest event" in beyond.json()["detail"]
        refused = await api.get("/v1/audit/digest", headers={"Authorization": f"Bearer {agent}"})
        assert_problem(refused, 403, "forbidden")
