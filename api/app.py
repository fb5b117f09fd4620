"""The FastAPI application: wires settings, the pool, the lock service and (optionally) the reaper."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import structlog
from fastapi import APIRouter, FastAPI
from fastapi_offline import FastAPIOffline

from api import (
    audit,
    commands,
    dashboard,
    feed,
    health,
    problems,
    queries,
    replay,
    reservations,
    sagas,
    shared_locks,
    stats,
    tokens,
)
from api.fast_path import CommandFastPath
from api.http_protocol import DRAIN
from api.limits import install_limits
from service import garbage_collection, loop_lag
from service.authenticator import Authenticator
from service.composition import (
    lock_service_on_pool,
    projector_runner_on_pool,
    reaper_on_pool,
    reservation_service_on_pool,
    shared_lock_service_on_pool,
)
from service.config import Settings
from service.database import create_pool
from service.database_guard import DatabaseGuard
from service.memory import MemoryTrimmer
from service.outage import OutageWatch
from service.retention import Retention
from service.store_adapters import Adapters

log = structlog.get_logger("lockledger.api")

DESCRIPTION = """
A distributed lock service for fleets of agents, event-sourced on PostgreSQL.

Acquire a lease with `POST /v1/locks/{resource}/acquire`, keep it alive with `renew` (the heartbeat),
and `release` it. Every success returns a **fencing token** that strictly increases per resource: pass it
to downstream systems and have them reject older tokens. Send an `Idempotency-Key` header on every command
so a retry after a timeout never takes a second lock or releases twice.

Every call but health and docs needs an API token (`Authorization: Bearer llt_...`, from `lockledger
tokens create --name NAME --role ROLE`): role `agent` holds leases as the token's name, `dashboard` reads
lock state, `investigator` also reads history, `admin` may do everything including force-release.

Errors are `application/problem+json` with a stable `code`. Timestamps are RFC 3339 in UTC with
microseconds, e.g. `2026-05-05T09:30:00.250000Z`. An instant sent in a query (`at`, `from`, `to`) is RFC
3339 with an offset, within years 1 to 9999 once in UTC and at most to the microsecond (further
fractional digits only if zeros); anything else is 422 `validation_error`. A header the service reads
once (`Authorization`, `Content-Type`, `Idempotency-Key`, ...) sent twice is 400 `bad_request`.
"""

DOCS_ASSETS = "/docs/static"


def create_app(
    settings: Settings | None = None, *, extra_command_routers: Sequence[APIRouter] = ()
) -> FastAPI:
    """The app for ``settings`` (from the environment when None). ``extra_command_routers`` are served
    like the commands, fast path included, and matched before them: the benchmark mounts its no-op
    twin this way (``bench/app.py``); the product mounts none."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Mapping[str, Any]]:
        pool = await create_pool(settings)
        app.state.pool = pool
        outage_watch = OutageWatch.for_settings(pool, settings)
        # Queries and history read through the read-only role, on a replica when one is configured.
        app.state.read_pool = await create_pool(
            settings,
            role=settings.read_database_role,
            url=settings.read_database_url,
            max_size=settings.read_pool_max_size,
        )
        app.state.lock_service = lock_service_on_pool(
            pool,
            settings.ttl_bounds,
            adapters=Adapters(
                order_in_flight=settings.order_in_flight,
                state_cache_size=settings.state_cache_size,
                coalesce=settings.coalesce,
                database_guard=settings.database_guard,
            ),
            guard=DatabaseGuard(stall_s=settings.command_timeout_s),
            conflict_retries=settings.conflict_retries,
            acquire_timeout_s=settings.pool_acquire_timeout_s,
            max_wait_ms=settings.max_wait_ms,
            wait_poll_s=settings.wait_poll_ms / 1000,
            outage_watch=outage_watch,
        )
        app.state.reservation_service = reservation_service_on_pool(
            pool,
            app.state.lock_service,
            settings.ttl_bounds,
            conflict_retries=settings.conflict_retries,
            acquire_timeout_s=settings.pool_acquire_timeout_s,
            max_wait_ms=settings.max_wait_ms,
            outage_watch=outage_watch,
        )
        app.state.shared_lock_service = shared_lock_service_on_pool(
            pool,
            app.state.lock_service,
            settings.ttl_bounds,
            conflict_retries=settings.conflict_retries,
            acquire_timeout_s=settings.pool_acquire_timeout_s,
            max_wait_ms=settings.max_wait_ms,
            outage_watch=outage_watch,
        )
        app.state.authenticator = (
            None
            if settings.dev_mode
            else Authenticator(
                pool,
                app.state.lock_service.guard,
                poll_s=settings.auth_cache_s,
                acquire_timeout_s=settings.pool_acquire_timeout_s,
            )
        )
        if settings.dev_mode:
            log.warning("DEV MODE: authentication is off; every caller is an anonymous admin")
        reaper_task = None
        reaper = None
        if settings.reaper_enabled:
            reaper = reaper_on_pool(pool, settings, outage_watch=outage_watch)
            reaper_task = asyncio.create_task(reaper.run(), name="reaper")
        retention = Retention(settings) if settings.retention_days is not None else None
        retention_task = asyncio.create_task(retention.run(), name="retention") if retention else None
        app.state.projectors = None
        if settings.projectors_enabled:
            app.state.projectors = projector_runner_on_pool(pool, settings)
            app.state.projectors.start()
        app.state.feed = await feed.start_feed(app.state.read_pool)  # the change feed's one reader
        app.state.memory = MemoryTrimmer()  # freed feed queues back to the OS when readers end
        lag_watch = asyncio.create_task(loop_lag.watch(), name="event-loop-lag")
        beacon = asyncio.create_task(outage_watch.run(), name="outage-beacon")
        garbage_collection.tune_after_startup()
        try:
            # The HTTP protocol finds the drain here when uvicorn begins a graceful shutdown.
            yield {DRAIN: app.state.lock_service.drain}
        finally:
            outage_watch.stop()
            await beacon
            lag_watch.cancel()
            await app.state.feed.stop()
            if app.state.projectors is not None:
                await app.state.projectors.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await lag_watch
            if reaper is not None and reaper_task is not None:
                reaper.stop()
                await reaper_task
            if retention is not None and retention_task is not None:
                retention.stop()
                await retention_task
            await app.state.lock_service.close()
            await app.state.read_pool.close()
            await pool.close()

    telemetry = settings.opentelemetry
    # /docs and /redoc load Swagger UI and ReDoc from the fastapi-offline package (under DOCS_ASSETS), not
    # from a CDN, so they work on a closed network. No trailing-slash redirects: an API's paths are
    # exact, and a redirect would send a resource of "/" (GET /v1/locks/%2F) to the list of every lock.
    app = FastAPIOffline(
        title="lockledger",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        telemetry={"tracing": telemetry, "metrics": telemetry, "logs": telemetry},
        static_url=DOCS_ASSETS,
        redirect_slashes=False,
    )
    app.state.settings = settings
    problems.install(app)
    # Extra routers first, where the commands are without them: a route the router matches later pays for
    # every route tried before it (commands reach the router only with OpenTelemetry on). Lock commands
    # and saga transitions are served alike (api/command_route.py).
    command_routers = [
        *extra_command_routers, commands.router, reservations.router, shared_locks.commands, sagas.commands,
    ]  # fmt: skip
    if not telemetry:
        # Innermost of the app's middleware (added first), so the request limits still see every request.
        routes = [route for router in command_routers for route in router.routes]
        app.add_middleware(CommandFastPath, routes=routes, exception_handlers=app.exception_handlers)
    install_limits(app, settings)
    for router in command_routers:
        app.include_router(router)
    app.include_router(queries.router)
    app.include_router(shared_locks.router)  # the reads; the commands are among the commands
    app.include_router(stats.router)
    app.include_router(replay.router)
    app.include_router(feed.router)
    app.include_router(sagas.router)  # the reads; the transitions are among the commands
    app.include_router(audit.router)
    app.include_router(tokens.router)
    app.include_router(health.router)
    app.include_router(dashboard.router)
    problems.document(app)
    return app
