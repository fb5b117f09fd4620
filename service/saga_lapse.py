"""The reaper's saga pass: finish, as far as the server can, every saga whose orchestrator stopped
heartbeating.

A pass takes the unfinished sagas whose lease deadline has passed by the store's clock
(``ReaperStore.due_sagas``, ``service/ports.py``) and sends each ``ExpireSagaLease`` through the saga
use case, so the decision is the decider's (``domain/saga.py``: compensate, complete, abort, record the
lapse, or make the saga stuck) and is committed at the expected version the pass loaded: a heartbeat or
a transition that commits first moves the deadline, and the lapse is decided again on the saga as it is
then (nothing lapses). Several reapers may run the pass at once for the same reason.
"""

from __future__ import annotations

import structlog
from prometheus_client import Counter

from domain.errors import DomainError
from domain.saga import ExpireSagaLease
from service.errors import Unavailable
from service.ports import DueSaga
from service.saga_service import SagaContext, SagaService

log = structlog.get_logger("lockledger.reaper")

SAGA_LAPSES_TOTAL = Counter(
    "lockledger_saga_lapses_total",
    "Saga leases lapsed by the reaper, by the status the saga was left in",
    ["status"],
)


async def lapse_sagas(sagas: SagaService, due: list[DueSaga], reaper_id: str) -> int:
    """Lapse the ``due`` sagas; the number whose lapse was recorded."""
    lapsed = 0
    for saga in due:
        saga_id = saga.saga_id
        try:
            result = await sagas.execute(ExpireSagaLease(saga_id, saga.now), SagaContext(principal="reaper"))
        except Unavailable as error:  # the database went away, or the saga is too contended: next pass
            log.warning("saga lapse not decided; next pass", saga_id=saga_id, error=str(error))
            return lapsed
        except DomainError as error:  # pragma: no cover - a lapse is never refused; logged should it be
            log.warning("saga lapse refused", saga_id=saga_id, error=str(error))
            continue
        if not result.changed:  # renewed meanwhile
            continue
        lapsed += 1
        status = str(result.view["status"])
        SAGA_LAPSES_TOTAL.labels(status=status).inc()
        log.info("saga lease lapsed", saga_id=saga_id, status=status, reaper_id=reaper_id)
    return lapsed
