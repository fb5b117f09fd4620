"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import structlog
from asyncpg.exceptions import TargetServerAttributeNotMatched
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from api.problems import problem
from api.request_checks import StrictRoute
from domain.timestamps import format_timestamp
from projections import queries
from service.database_guard import NOT_PRIMARY
from service.errors import Unavailable

log = structlog.get_logger("lockledger.api")

router = APIRouter(tags=["operations"], route_class=StrictRoute)

LEASES_HELD_SCRAPE_TIMEOUT_S = 1.0
NO_WRITABLE_PRIMARY = "no writable primary: the database takes no writes now (a failover in progress?)"


class LeasesHeld:
    """``lockledger_leases_held``: the live leases in ``lock_state``, counted by the database when
    ``/metrics`` is scraped (no loop keeps it fresh between scrapes). The gauge is left out of a scrape
    whose count failed, rather than showing a stale number."""

    NAME = "lockledger_leases_held"
    HELP = (
        "Leases held now (deadline ahead) per the lock_state table, counted when scraped. Database-wide:"
        " every server process reports the same number, so aggregate with max, never sum."
    )

    def __init__(self) -> None:
        self.value: int | None = None

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.HELP)

    def collect(self) -> Iterator[Metric]:
        if self.value is not None:
            yield GaugeMetricFamily(self.NAME, self.HELP, value=self.value)


LEASES_HELD = LeasesHeld()
REGISTRY.register(LEASES_HELD)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (it does not look at the database)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "the database is not answering"}})
async def readyz(request: Request) -> Response:
    """Ready to serve commands: a round trip through the same database guard as the commands succeeds
    within a second, on a primary that takes writes (``no writable primary`` otherwise). While the guard
    is open this answers 503 at once; once its wait has passed, this check is one of the probes that
    close it again."""
    pool = request.app.state.pool

    async def probe() -> bool:
        async with asyncio.timeout(1.0), pool.acquire() as conn:
            return bool(await conn.fetchval("SELECT current_setting('transaction_read_only') = 'off'"))

    try:
        writable = await request.app.state.lock_service.guard.run(probe)
    except Exception as error:  # any failure to reach the database means not ready
        if isinstance(error, Unavailable):
            detail = error.detail
        elif isinstance(error, (*NOT_PRIMARY, TargetServerAttributeNotMatched)):
            detail = f"{NO_WRITABLE_PRIMARY} ({type(error).__name__})"
        else:
            detail = f"database not ready: {type(error).__name__}"
        return problem(503, "unavailable", detail, headers={"Retry-After": "1"})
    if not writable:
        await pool.expire_connections()
        return problem(503, "unavailable", NO_WRITABLE_PRIMARY, headers={"Retry-After": "1"})
    return JSONResponse({"status": "ready", "projectors": _projectors(request)})


def _projectors(request: Request) -> dict[str, dict[str, float | str | None]]:
    """Each asynchronous projector's lag in this process, and the instant replay may read it up to
    (detail only: a lagging projector makes replay slower, not wrong, so it leaves the server ready)."""
    runner = request.app.state.projectors
    if runner is None:
        return {}
    return {
        s.name: {
            "lag_seconds": None if s.lag_s is None else round(s.lag_s, 3),
            "covered_until": None if s.covered_until is None else format_timestamp(s.covered_until),
        }
        for s in runner.status()
    }


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    LEASES_HELD.value = await _count_leases_held(request)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _count_leases_held(request: Request) -> int | None:
    """The live-lease count through the read pool, within a second; None when the database cannot tell
    (the rest of the scrape is still answered: it says most while the database is down)."""
    if request.app.state.lock_service.guard.stalled_for() > 0:
        return None
    try:
        async with (
            asyncio.timeout(LEASES_HELD_SCRAPE_TIMEOUT_S),
            request.app.state.read_pool.acquire() as conn,
        ):
            return await queries.count_live_leases(conn)
    except Exception as error:  # any failure only leaves the gauge out of this scrape
        log.warning("leases held not counted", error=repr(error))
        return None
