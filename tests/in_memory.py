"""The use cases wired to the in-memory fakes (``service/fakes/``), as ``service/composition.py`` wires
them to PostgreSQL: for behaviour tests that need no database. The contract suite
(``tests/service/test_store_contract.py``) is what lets the fakes stand in for PostgreSQL here."""

from __future__ import annotations

from domain.resource import TtlBounds
from service.config import Settings
from service.database_guard import DatabaseGuard
from service.fakes.database import MemoryDatabase
from service.fakes.lock_store import MemoryLockStore
from service.fakes.notifier import MemoryNotifier
from service.fakes.reaper_store import MemoryReaperStore
from service.fakes.reservation_store import MemoryReservationStore
from service.fakes.saga_store import MemorySagaStore
from service.lock_service import LockService
from service.reaper import Reaper
from service.reservation_service import ReservationService
from service.saga_service import SagaService
from service.store_adapters import Adapters, build_store
from service.waiters import Waiters


def lock_service_in_memory(
    database: MemoryDatabase,
    bounds: TtlBounds,
    *,
    adapters: Adapters | None = None,
    max_wait_ms: int = 30_000,
    wait_poll_s: float = 0.05,
) -> LockService:
    """The lock use case on ``database``, its store wrapped in ``adapters`` (all on unless said
    otherwise), as one server process: several on one database are several processes."""
    guard = DatabaseGuard()
    store = build_store(MemoryLockStore(database), guard, adapters or Adapters(), database.clock)
    waiters = Waiters(MemoryNotifier(database), poll_s=wait_poll_s)
    return LockService(store, bounds, waiters, guard, max_wait_ms=max_wait_ms)


def reservation_service_in_memory(
    database: MemoryDatabase, locks: LockService, bounds: TtlBounds, *, max_wait_ms: int = 30_000
) -> ReservationService:
    """The reservation use case on ``database``, beside the lock use case ``locks`` of the same process."""
    return ReservationService(
        locks.store, MemoryReservationStore(database), bounds, locks.waiters, max_wait_ms=max_wait_ms
    )


def saga_service_in_memory(database: MemoryDatabase) -> SagaService:
    return SagaService(MemorySagaStore(database), DatabaseGuard())


def reaper_in_memory(database: MemoryDatabase, settings: Settings, reaper_id: str = "reaper") -> Reaper:
    return Reaper(
        MemoryReaperStore(database), saga_service_in_memory(database), settings, reaper_id=reaper_id
    )
