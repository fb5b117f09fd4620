"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.problems import problem
from service.errors import Unavailable

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (it does not look at the database)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "the database is not answering"}})
async def readyz(request: Request) -> Response:
    """Ready to serve commands: a round trip through the same database guard as the commands succeeds
    within a second. While the guard is open this answers 503 at once; once its wait has passed, this
    check is one of the probes that close it again."""
    pool = request.app.state.pool

    async def probe() -> None:
        async with asyncio.timeout(1.0), pool.acquire() as conn:
            await conn.fetchval("SELECT 1")

    try:
        await request.app.state.lock_service.guard.run(probe)
    except Exception as error:  # any failure to reach the database means not ready
        detail = (
            error.detail if isinstance(error, Unavailable) else f"database not ready: {type(error).__name__}"
        )
        return problem(503, "unavailable", detail, headers={"Retry-After": "1"})
    return JSONResponse({"status": "ready"})


@router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
