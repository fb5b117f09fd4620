"""The use cases wired to their PostgreSQL adapters: what the server and the reaper command run.

The use cases take their ports by constructor (``service/ports.py``); this is the one place that picks
the PostgreSQL adapters for them, so tests can wire the in-memory fakes (``service/fakes/``) instead.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import asyncpg

from domain.resource import TtlBounds
from service.clock import SystemClock
from service.config import Settings
from service.database_guard import DatabaseGuard
from service.lock_service import LockService
from service.notifier import PostgresNotifier
from service.outage import OutageWatch
from service.ports import SharedLockStore
from service.projectors import ProjectorRunner
from service.queue_store import PostgresQueue, QueueListener
from service.reaper import Reaper
from service.reaper_store import PostgresReaperStore
from service.reservation_service import ReservationService
from service.reservation_store import GuardedReservations, PostgresReservationStore
from service.saga_service import SagaService
from service.saga_store import PostgresSagaStore
from service.shared_lock_service import SharedLockService
from service.shared_lock_store import PostgresSharedLockStore, SharedAfterOutage, SharedInFlightOrdering
from service.store import PostgresStore
from service.store_adapters import Adapters, build_store
from service.waiters import Waiters


def server_name() -> str:
    """This server process as the queue's tickets name it: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


def lock_service_on_pool(
    pool: asyncpg.Pool,
    bounds: TtlBounds,
    *,
    adapters: Adapters | None = None,
    guard: DatabaseGuard | None = None,
    conflict_retries: int = 16,
    acquire_timeout_s: float = 5.0,
    max_wait_ms: int = 30_000,
    wait_poll_s: float = 0.05,
    outage_watch: OutageWatch | None = None,
) -> LockService:
    """The lock use case on PostgreSQL, its store wrapped in ``adapters`` (all on unless said otherwise),
    and extending leases after an outage when given the process's ``outage_watch``."""
    guard = guard or DatabaseGuard()
    store = build_store(
        PostgresStore(pool, acquire_timeout_s), guard, adapters or Adapters(), SystemClock(), outage_watch
    )
    waiters = Waiters(
        PostgresNotifier(pool, acquire_timeout_s),
        poll_s=wait_poll_s,
        queue=PostgresQueue(pool, acquire_timeout_s, server_name()),
        listen=lambda on_wake, on_lost: QueueListener(pool, acquire_timeout_s, on_wake, on_lost),
    )
    return LockService(
        store, bounds, waiters, guard, conflict_retries=conflict_retries, max_wait_ms=max_wait_ms
    )


def reservation_service_on_pool(
    pool: asyncpg.Pool,
    locks: LockService,
    bounds: TtlBounds,
    *,
    conflict_retries: int = 16,
    acquire_timeout_s: float = 5.0,
    max_wait_ms: int = 30_000,
    outage_watch: OutageWatch | None = None,
) -> ReservationService:
    """The reservation use case beside ``locks``: it loads through the lock service's store (with its
    adapters), waits with its waiters, and commits through ``locks``' database guard."""
    atomic = GuardedReservations(PostgresReservationStore(pool, acquire_timeout_s), locks.guard, outage_watch)
    return ReservationService(
        locks.store, atomic, bounds, locks.waiters, conflict_retries=conflict_retries, max_wait_ms=max_wait_ms
    )


def shared_lock_service_on_pool(
    pool: asyncpg.Pool,
    locks: LockService,
    bounds: TtlBounds,
    *,
    conflict_retries: int = 16,
    acquire_timeout_s: float = 5.0,
    max_wait_ms: int = 30_000,
    outage_watch: OutageWatch | None = None,
) -> SharedLockService:
    """The shared-lock use case beside ``locks``: it waits in the same queues (keyed by its stream ids)
    with the lock service's waiters, runs through its database guard, and after an outage extends
    first when given the process's ``outage_watch``."""
    store: SharedLockStore = PostgresSharedLockStore(pool, acquire_timeout_s)
    if outage_watch is not None:
        store = SharedAfterOutage(store, outage_watch)
    store = SharedInFlightOrdering(store)
    return SharedLockService(
        store, bounds, locks.waiters, locks.guard, conflict_retries=conflict_retries, max_wait_ms=max_wait_ms
    )


def saga_service_on_pool(
    pool: asyncpg.Pool, guard: DatabaseGuard, *, acquire_timeout_s: float = 5.0, conflict_retries: int = 16
) -> SagaService:
    """The saga use case on PostgreSQL, every round trip through ``guard``."""
    store = PostgresSagaStore(pool, acquire_timeout_s)
    return SagaService(store, guard, conflict_retries=conflict_retries)


def reaper_on_pool(
    pool: asyncpg.Pool,
    settings: Settings,
    *,
    reaper_id: str | None = None,
    outage_watch: OutageWatch | None = None,
) -> Reaper:
    """The reaper on PostgreSQL, its saga pass through a saga use case of its own (and its own guard)."""
    timeout_s = settings.pool_acquire_timeout_s
    sagas = saga_service_on_pool(
        pool, DatabaseGuard(), acquire_timeout_s=timeout_s, conflict_retries=settings.conflict_retries
    )
    store = PostgresReaperStore(pool, timeout_s)
    # Its shared-lock expiries wake the queues through the database; the reaper itself never waits.
    waiters = Waiters(
        PostgresNotifier(pool, timeout_s), poll_s=1.0, queue=PostgresQueue(pool, timeout_s, server_name())
    )
    shared = SharedLockService(
        PostgresSharedLockStore(pool, timeout_s), settings.ttl_bounds, waiters, DatabaseGuard(),
        conflict_retries=settings.conflict_retries,
    )  # fmt: skip
    return Reaper(store, sagas, settings, reaper_id=reaper_id, outage_watch=outage_watch, shared=shared)


def projector_runner_on_pool(pool: asyncpg.Pool, settings: Settings) -> ProjectorRunner:
    """The asynchronous projectors, kept up with the log through ``pool`` (the service role's); an instant
    counts as covered once the writers' statement_timeout has passed since a mark after it."""
    settle = timedelta(milliseconds=settings.statement_timeout_ms)
    return ProjectorRunner(pool, poll_s=settings.projector_poll_ms / 1000, settle=settle)
