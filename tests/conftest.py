"""Shared fixtures: a real PostgreSQL for every storage test, and a real HTTP server for end-to-end tests.

PostgreSQL comes from ``LOCKLEDGER_TEST_DATABASE_URL`` when set (a fresh database is created on that
server for this run and dropped after it), otherwise from the embedded server in a temporary directory.
Events cannot be deleted (that is the point), so tests isolate themselves by resource name, not by
truncation: use the ``resource`` fixture or ``unique_prefix``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil
import pytest

from domain.access import Role
from eventstore.dburl import asyncpg_dsn
from migrations.upgrade import upgrade
from service import tokens
from service.composition import lock_service_on_pool
from service.config import Settings
from service.database import create_pool
from service.lock_service import LockService
from service.outcomes import CommandResult, Granted

TEST_DATABASE_URL_ENV = "LOCKLEDGER_TEST_DATABASE_URL"
PROBLEM_JSON = "application/problem+json"


@dataclass
class TestDatabase:
    __test__ = False  # a fixture value, not a test class
    url: str
    postgres_pid: int | None  # the embedded server's postmaster, for fault tests; None for an external one


def _replace_database(url: str, database: str) -> str:
    """The same server URL pointing at another database (handles ``?host=`` socket URLs)."""
    head, sep, query = url.partition("?")
    scheme_host, _, _ = head.rpartition("/")
    return f"{scheme_host}/{database}{sep}{query}"


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
        _run_admin(external, f'CREATE DATABASE "{name}"')
        url = _replace_database(external, name)
        upgrade(url)
        try:
            yield TestDatabase(url, None)
        finally:
            _run_admin(external, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
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


def _run_admin(url: str, sql: str) -> None:
    import asyncio

    async def run() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture(scope="session")
def database_url(test_database: TestDatabase) -> str:
    return test_database.url


@contextlib.contextmanager
def scratch_database(database_url: str) -> Iterator[str]:
    """A migrated database of its own on the test server, dropped when the block ends."""
    name = f"lockledger_scratch_{uuid.uuid4().hex[:8]}"
    _run_admin(database_url, f'CREATE DATABASE "{name}"')
    url = _replace_database(database_url, name)
    upgrade(url)
    try:
        yield url
    finally:
        _run_admin(database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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


def granted(result: CommandResult) -> Granted:
    """The lease a command's result granted (fails the test if it granted none)."""
    assert isinstance(result.outcome, Granted), result
    return result.outcome


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """An RFC 9457 problem with the lockledger fields, and nothing that looks like a server error."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_JSON
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["code"] == code
    assert body["type"] == f"urn:lockledger:problem:{code}"
    assert isinstance(body["title"], str)
    assert body["title"]
    assert isinstance(body["detail"], str)
    assert body["detail"]
    return body


@contextlib.contextmanager
def frozen(postmaster_pid: int) -> Iterator[None]:
    """SIGSTOP the whole cluster (postmaster and every backend); SIGCONT whatever happens."""
    postmaster = psutil.Process(postmaster_pid)
    processes = [postmaster, *postmaster.children(recursive=True)]
    for process in processes:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A `lockledger serve` subprocess on 127.0.0.1; restartable for crash tests."""

    database_url: str
    port: int
    env_overrides: dict[str, str]
    log_path: Path | None = None  # where its stdout and stderr go (appended across restarts); else discarded
    process: subprocess.Popen[bytes] | None = None
    workers: int = 1

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _failed(self, what: str) -> RuntimeError:
        tail = ""
        if self.log_path is not None and self.log_path.exists():
            tail = "\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        return RuntimeError(f"lockledger serve {what}{tail}")

    def start(self, timeout_s: float = 30.0) -> None:
        # Dev mode (no authentication) unless a test turns it off: most tests are about locks, not tokens.
        env = {
            **os.environ,
            "LOCKLEDGER_DATABASE_URL": self.database_url,
            "LOCKLEDGER_DEV_MODE": "true",
            **self.env_overrides,
        }
        log = self.log_path.open("ab") if self.log_path is not None else None
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "api.cli",
                    "serve",
                    "--port",
                    str(self.port),
                    "--workers",
                    str(self.workers),
                ],
                env=env,
                stdout=log or subprocess.DEVNULL,
                stderr=log or subprocess.DEVNULL,
            )
        finally:
            if log is not None:
                log.close()  # the child has its own descriptor
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failed(f"exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise self._failed("did not become ready")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, in-flight requests die mid-way."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, and SIGKILL if it has not ended within 10 s."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextlib.contextmanager
def running_server(database_url: str, env_overrides: dict[str, str]) -> Iterator[ServerProcess]:
    """A started server on a free port, stopped when the block ends, however it ends."""
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="lockledger-server-")) / f"serve-{port}.log"
    proc = ServerProcess(database_url, port, env_overrides, log_path=log_path)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(log_path.parent, ignore_errors=True)


# The shared server: its reaper every 100 ms; acquires wait at most 2 s (the fuzzer sends wait_ms of every
# size to locks it may hold already).
SERVER_SETTINGS = {"LOCKLEDGER_REAPER_INTERVAL_MS": "100", "LOCKLEDGER_MAX_WAIT_MS": "2000"}
# Authentication on, as in production; token lookups cached briefly so revocation tests need not wait 10 s.
AUTH_SERVER_SETTINGS = {
    "LOCKLEDGER_DEV_MODE": "false",
    "LOCKLEDGER_AUTH_CACHE_S": "0.5",
    "LOCKLEDGER_REAPER_ENABLED": "false",
    "LOCKLEDGER_MAX_WAIT_MS": "2000",
}


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


IssueToken = Callable[[str, Role], Awaitable[str]]


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
