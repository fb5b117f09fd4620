"""Shared fixtures: a real PostgreSQL for every storage test, and a real HTTP server for end-to-end tests.

PostgreSQL comes from ``LOCKLEDGER_TEST_DATABASE_URL`` when set (a fresh database is created on that
server for this run and dropped after it), otherwise from the embedded server in a temporary directory.
Events cannot be deleted (that is the point), so tests isolate themselves by resource name, not by
truncation: use the ``resource`` fixture or ``unique_prefix``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from domain.access import Role
from migrations.upgrade import upgrade
from service import tokens
from service.composition import lock_service_on_pool
from service.config import Settings
from service.database import create_pool
from service.lock_service import LockService
from tests.databases import TEST_DATABASE_URL_ENV, TestDatabase, replace_database, run_admin, scratch_database
from tests.servers import AUTH_SERVER_SETTINGS, SERVER_SETTINGS, IssueToken, ServerProcess, running_server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that reaches the shared PostgreSQL server (`make test-fast` leaves them out)."""
    for item in items:
        if "test_database" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used a server shows the end of that server's log (its warnings say why a
    command was refused, e.g. a database it found unreachable)."""
    report = yield
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, ServerProcess) and value.log_path is not None and value.log_path.exists():
                tail = value.log_path.read_text(errors="replace").splitlines()[-40:]
                report.sections.append((f"server log {value.base_url} (last 40 lines)", "\n".join(tail)))
    return report


@pytest.fixture(scope="session")
def test_database() -> Iterator[TestDatabase]:
    external = os.environ.get(TEST_DATABASE_URL_ENV)
    name = f"lockledger_test_{uuid.uuid4().hex[:10]}"
    if external:
        run_admin(external, f'CREATE DATABASE "{name}"')
        url = replace_database(external, name)
        upgrade(url)
        try:
            yield TestDatabase(url, None)
        finally:
            run_admin(external, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        return
    from eventstore.embedded import start

    scratch = Path(tempfile.mkdtemp(prefix="lockledger-test-"))
    server = start(scratch / "pgdata", delete_on_stop=True)
    try:
        url = server.ensure_database(name)
        upgrade(url)
        yield TestDatabase(url, server.pid)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="session")
def database_url(test_database: TestDatabase) -> str:
    return test_database.url


@pytest.fixture
def scratch_database_url(database_url: str) -> Iterator[str]:
    """A database of its own for a test that changes database-wide things (settings, the outage beacon)."""
    with scratch_database(database_url) as url:
        yield url


@pytest.fixture(scope="module")
def own_database(database_url: str) -> Iterator[str]:
    """A migrated database of the module's own: no test server's reaper works on it, and no other
    module's test sees what it holds (leases left to lapse, histories written without lock_state rows,
    which a rebuild test on the shared database would find)."""
    with scratch_database(database_url) as url:
        yield url


@pytest.fixture(scope="module")
async def own_service_pool(own_database: str) -> AsyncIterator[asyncpg.Pool]:
    """``service_pool`` on the module's own database."""
    pool = await create_pool(Settings(database_url=own_database, reaper_enabled=False))
    yield pool
    await pool.close()


@pytest.fixture(scope="module")
async def own_admin_pool(own_database: str) -> AsyncIterator[asyncpg.Pool]:
    """``admin_pool`` on the module's own database."""
    pool = await create_pool(Settings(database_url=own_database, reaper_enabled=False), role="")
    yield pool
    await pool.close()


@pytest.fixture(scope="session")
def settings(database_url: str) -> Settings:
    return Settings(database_url=database_url, reaper_enabled=False)


@pytest.fixture(scope="session")
async def service_pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    """A pool running as the least-privileged service role, as the server does."""
    pool = await create_pool(settings)
    yield pool
    await pool.close()


@pytest.fixture(scope="session")
async def admin_pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    """A pool as the schema owner, for inspection and for operations the service may not do."""
    pool = await create_pool(settings, role="")
    yield pool
    await pool.close()


@pytest.fixture(scope="session")
def lock_service(service_pool: asyncpg.Pool, settings: Settings) -> LockService:
    return lock_service_on_pool(service_pool, settings.ttl_bounds, conflict_retries=settings.conflict_retries)


@pytest.fixture
def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def resource(unique_prefix: str) -> str:
    return f"{unique_prefix}zone"


@pytest.fixture(scope="session")
def server(database_url: str) -> Iterator[ServerProcess]:
    """One real HTTP server with its reaper, shared by the end-to-end tests."""
    with running_server(database_url, SERVER_SETTINGS) as proc:
        yield proc


@pytest.fixture(scope="session")
def auth_server(database_url: str) -> Iterator[ServerProcess]:
    """A server with authentication on, shared by the tests of tokens and roles."""
    with running_server(database_url, AUTH_SERVER_SETTINGS) as proc:
        yield proc


@pytest.fixture
def issue_token(admin_pool: asyncpg.Pool) -> IssueToken:
    """Mint an API token as an administrator would (`lockledger tokens create`)."""

    async def issue(name: str, role: Role) -> str:
        async with admin_pool.acquire() as conn:
            return await tokens.create(conn, name, role)

    return issue


@pytest.fixture
async def http(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0, limits=limits) as client:
        yield client
