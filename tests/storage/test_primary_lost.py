"""The database stops taking writes (a failover demotes the primary to a standby): commands answer 503
with ``Retry-After``, never 500, ``/readyz`` says there is no writable primary, the pool drops its
connections, and once writes are taken again the service goes on by itself with nothing lost.

A standby is played by a database whose sessions are read-only (``default_transaction_read_only``),
entered the way a failover is entered: every session of the service terminated by the administrator.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg
import httpx
import pytest

from api.health import NO_WRITABLE_PRIMARY
from eventstore.dburl import asyncpg_dsn
from tests.assertions import PROBLEM_JSON
from tests.servers import ServerProcess, free_port

pytestmark = [pytest.mark.storage, pytest.mark.slow]


async def _demote(admin_url: str, database: str, *, read_only: bool) -> None:
    """Make ``database`` read-only (or writable again) and end every session on it, as a failover does."""
    conn = await asyncpg.connect(asyncpg_dsn(admin_url))
    try:
        setting = (
            "SET default_transaction_read_only = on" if read_only else "RESET default_transaction_read_only"
        )
        await conn.execute(f'ALTER DATABASE "{database}" {setting}')
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            database,
        )
    finally:
        await conn.close()


async def test_commands_answer_503_while_no_primary_takes_writes(
    database_url: str, scratch_database_url: str
) -> None:
    database = scratch_database_url.partition("?")[0].rpartition("/")[2]
    server = ServerProcess(scratch_database_url, free_port(), {})
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as http:
            held = await http.post("/v1/locks/pallet-1/acquire", json={"owner": "agv-1", "ttl_ms": 120_000})
            assert held.status_code == 201, held.text
            token = held.json()["fencing_token"]

            await _demote(database_url, database, read_only=True)

            details = []
            for _ in range(5):  # the first probe may still meet a connection the termination closed
                ready = await http.get("/readyz")
                assert ready.status_code == 503
                details.append(ready.json()["detail"])
                if details[-1].startswith(NO_WRITABLE_PRIMARY):
                    break
                await asyncio.sleep(0.2)
            assert details[-1].startswith(NO_WRITABLE_PRIMARY), details

            answers = await asyncio.gather(
                *(http.post(f"/v1/locks/zone-{i}/acquire", json={"owner": f"agv-{i}"}) for i in range(20)),
                http.post("/v1/locks/pallet-1/renew", json={"owner": "agv-1", "fencing_token": token}),
            )
            for answer in answers:
                assert answer.status_code == 503, answer.text
                assert answer.headers["content-type"].startswith(PROBLEM_JSON)
                assert int(answer.headers["retry-after"]) >= 1

            await _demote(database_url, database, read_only=False)

            deadline = time.monotonic() + 30
            after = None
            while time.monotonic() < deadline:
                after = await http.post("/v1/locks/zone-after/acquire", json={"owner": "agv-9"})
                if after.status_code == 201:
                    break
                assert after.status_code == 503, after.text
                await asyncio.sleep(0.3)
            assert after is not None
            assert after.status_code == 201, "the service did not take writes again"
            assert (await http.get("/readyz")).status_code == 200

            renewed = await http.post(
                "/v1/locks/pallet-1/renew", json={"owner": "agv-1", "fencing_token": token}
            )
            assert renewed.status_code == 200, renewed.text  # the lease granted before the demotion survived
            for i in range(20):  # nothing refused during the demotion was granted behind the client's back
                state = await http.get(f"/v1/locks/zone-{i}")
                assert state.status_code in (200, 404)
                if state.status_code == 200:
                    assert state.json().get("holder") is None, state.text
    finally:
        server.stop()
