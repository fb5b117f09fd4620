"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.problems import problem

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (it does not look at the database)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "the database is not answering"}})
async def readyz(request: Request) -> Response:
    """Ready to serve commands: the database answers within a second, and the guard that fails commands
    fast while it does not is closed."""
    if not request.app.state.lock_service.guard.available:
        return problem(
            503, "unavailable", "database unavailable (the guard is open)", headers={"Retry-After": "1"}
        )
    try:
        async with asyncio.timeout(1.0):
            async with request.app.state.pool.acquire() as conn:
                await conn.fetchval("SELECT 1")
    except Exception as error:  # any failure to reach the database means not ready
        return problem(
            503, "unavailable", f"database not ready: {type(error).__name__}", headers={"Retry-After": "1"}
        )
    return JSONResponse({"status": "ready"})


@router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
