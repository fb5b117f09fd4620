"""Queries and history are served through the read-only role, so they could be pointed at a replica and
could never write, whatever a bug in them did."""

from __future__ import annotations

import asyncpg
import httpx
import pytest

from api.app import create_app
from service.config import Settings

pytestmark = pytest.mark.storage


async def test_queries_read_through_the_readonly_role(database_url: str, resource: str) -> None:
    app = create_app(Settings(database_url=database_url, reaper_enabled=False, dev_mode=True))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://lockledger") as client,
    ):
        async with app.state.read_pool.acquire() as conn:
            assert await conn.fetchval("SELECT current_user") == "lockledger_readonly"
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("DELETE FROM lock_state WHERE resource = $1", resource)
        acquired = await client.post(f"/v1/locks/{resource}/acquire", json={"owner": "bot1", "ttl_ms": 5000})
        assert acquired.status_code == 201
        assert (await client.get(f"/v1/locks/{resource}")).json()["owner"] == "bot1"
        assert (await client.get("/v1/locks", params={"prefix": resource})).json()["items"][0][
            "owner"
        ] == "bot1"
        history = (await client.get(f"/v1/locks/{resource}/history")).json()["events"]
        assert [e["type"] for e in history] == ["LOCK_ACQUIRED"]
