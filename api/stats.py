"""``GET /v1/stats``: this process's command and expiry counters and the live-lease count; and
``GET /v1/stats/agents``: per agent figures from the agent_stats projection (database-wide).

Counters are per process (each worker has its own) and start at zero: the dashboard computes rates from
the difference of two reads and skips a pair whose ``process.id`` differs (a restart, or another worker
behind a load balancer). The Prometheus ``/metrics`` carries the same counters for monitoring systems.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from prometheus_client import Counter

from api.auth import require
from api.request_checks import StrictRoute
from api.stats_models import AgentFigures, AgentStatsPage, ServerProcess, Stats
from domain.access import Action
from projections import agent_stats, queries
from service.lock_service import COMMANDS_TOTAL
from service.reaper import EXPIRED_TOTAL

router = APIRouter(
    tags=["queries"], route_class=StrictRoute, dependencies=[Depends(require(Action.READ_STATE))]
)

PROCESS = ServerProcess(id=uuid.uuid4().hex, started_at=datetime.now(UTC))


def _total(counter: Counter) -> int:
    return sum(int(s.value) for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _commands() -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for metric in COMMANDS_TOTAL.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                by_outcome = counts.setdefault(sample.labels["command"], {})
                by_outcome[sample.labels["outcome"]] = int(sample.value)
    return counts


@router.get("/v1/stats", response_model=Stats)
async def stats(request: Request) -> Stats:
    """This process's counters since it started, the live leases (database-wide) and this process's
    clock, for rates from two reads."""
    async with request.app.state.read_pool.acquire() as conn:
        held = await queries.count_live_leases(conn)
    return Stats(
        at=datetime.now(UTC),
        process=PROCESS,
        commands=_commands(),
        leases_expired=_total(EXPIRED_TOTAL),
        leases_held=held,
    )


@router.get("/v1/stats/agents", response_model=AgentStatsPage)
async def agents(
    request: Request,
    zone_prefix: Annotated[
        str | None,
        Query(
            pattern=r"^[A-Za-z0-9._:\-]{0,200}$",
            description="Only zones (a resource up to its last `:`) starting with this.",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AgentStatsPage:
    """Per agent: leases taken, ended, mean hold time and lapses, over every zone or a zone prefix."""
    async with request.app.state.read_pool.acquire() as conn:
        rows = await agent_stats.by_agent(conn, zone_prefix=zone_prefix, limit=limit)
    return AgentStatsPage(
        items=[
            AgentFigures(
                owner=r.owner, holds=r.holds, ended=r.ended, mean_hold_ms=r.mean_hold_ms, lapses=r.lapses
            )
            for r in rows
        ]
    )
