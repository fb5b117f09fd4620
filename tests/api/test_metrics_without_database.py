"""``/metrics`` still answers when the database cannot count the live leases: the gauge is left out
rather than showing a stale number (its counting against a real database: tests/storage)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from api.health import LEASES_HELD
from service.database_guard import DatabaseGuard
from tests.api.routing import bench_app


class Unreachable:
    """A read pool whose every connection attempt is refused."""

    def acquire(self) -> Any:
        raise OSError("connection refused")


async def test_the_gauge_is_left_out_when_the_count_fails() -> None:
    app = bench_app()
    app.state.authenticator = None
    app.state.lock_service = SimpleNamespace(guard=DatabaseGuard())
    app.state.read_pool = Unreachable()
    LEASES_HELD.value = 7  # what an earlier scrape counted
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert "lockledger_event_loop_lag_seconds" in names  # the rest of the scrape is there
    assert "lockledger_leases_held" not in names
