"""``GET /v1/stats``: this process's command and expiry counters and the live-lease count.

Counters are per process (each worker has its own) and start at zero: the dashboard computes rates from
the difference of two reads and skips a pair whose ``process.id`` differs (a restart, or another worker
behind a load balancer). The Prometheus ``/metrics`` carries the same counters for monitoring systems.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request
from prometheus_client import Counter

from api.auth import require
from api.request_checks import StrictRoute
from api.stats_models import ServerProcess, Stats
from domain.access import Action
from projections import queries
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
