"""A multi-host URL whose first server accepts connections and never answers (a frozen host): the
service's pool still reaches the next server, where asyncpg alone would spend its whole connect timeout
on the first. Uses the machine's PostgreSQL on 127.0.0.1:5432 as the server that answers (skipped
without one): the embedded test server listens on a Unix socket only."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import asyncpg
import pytest

from service.config import Settings
from service.database import create_pool

pytestmark = [pytest.mark.storage, pytest.mark.slow]

ANSWERING = "127.0.0.1:5432"


@pytest.fixture
def frozen_port() -> Iterator[int]:
    """A port that accepts connections (the kernel completes the handshake) and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


async def _answers() -> bool:
    try:
        conn = await asyncpg.connect(f"postgresql://postgres@{ANSWERING}/postgres", timeout=3)
    except (OSError, TimeoutError, asyncpg.PostgresError):
        return False
    await conn.close()
    return True


async def test_a_frozen_first_host_does_not_keep_the_pool_from_the_next(frozen_port: int) -> None:
    if not await _answers():
        pytest.skip(f"no PostgreSQL answers on {ANSWERING}")
    url = (
        f"postgresql://postgres@127.0.0.1:{frozen_port},{ANSWERING}/postgres?target_session_attrs=read-write"
    )

    with pytest.raises(TimeoutError):  # asyncpg alone: the frozen host takes the whole attempt
        await asyncpg.connect(url, timeout=5)

    settings = Settings(database_url=url, pool_min_size=2, pool_max_size=2)
    async with asyncio.timeout(30):  # a bound for a hang, not a measurement: two hosts' 3 s each at most
        pool = await create_pool(settings, role="")
    try:
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT current_setting('transaction_read_only')") == "off"
    finally:
        await pool.close()
