"""The page's tests get servers and a database of their own: what they assert (a lock among the first
1,000 shown, a saga lapsing within seconds) must not depend on what the suite's other tests left in the
shared database, nor on the shared servers having lived through its frozen-database and paused-process
tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from service.config import Settings
from service.database import create_pool
from tests.databases import scratch_database
from tests.servers import AUTH_SERVER_SETTINGS, SERVER_SETTINGS, ServerProcess, running_server


@pytest.fixture(scope="session")
def page_database_url(database_url: str) -> Iterator[str]:
    with scratch_database(database_url) as url:
        yield url


# Acquires may wait as long as they ask (the shared server cuts waits to 2 s): the page shows a lock's
# queue, and its waiters must stay queued across the page's polls.
PAGE_SERVER_SETTINGS = {**SERVER_SETTINGS, "LOCKLEDGER_MAX_WAIT_MS": "60000"}


@pytest.fixture(scope="session")
def server(page_database_url: str) -> Iterator[ServerProcess]:
    with running_server(page_database_url, PAGE_SERVER_SETTINGS) as proc:
        yield proc


@pytest.fixture(scope="session")
def auth_server(page_database_url: str) -> Iterator[ServerProcess]:
    with running_server(page_database_url, AUTH_SERVER_SETTINGS) as proc:
        yield proc


@pytest.fixture(scope="session")
async def admin_pool(page_database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """As the schema owner, on the page's database (where `issue_token` mints its tokens)."""
    pool = await create_pool(Settings(database_url=page_database_url, reaper_enabled=False), role="")
    yield pool
    await pool.close()
