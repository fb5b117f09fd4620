"""The reaper: expires leases whose holders stopped heartbeating, lapses sagas whose orchestrators did,
purges old Idempotency-Keys and lapsed queue tickets, and creates the event log's partitions ahead (at
its first pass, then every few minutes; docs/operations.md).

A pass asks the ``ReaperStore`` port (``service/ports.py``; in PostgreSQL ``service/reaper_store.py``)
to expire what is due, safely with several reapers at once and never racing a renew that committed
first, then lapses the due sagas through the saga use case (``service/saga_lapse.py``) and expires the
lapsed grants of shared locks through theirs (``SHARED_EXPIRED``, waking their queues).
"""

from __future__ import annotations

import asyncio
import time

import asyncpg
import structlog
from prometheus_client import Counter, Histogram

from service.config import Settings
from service.outage import OutageWatch, instance_id
from service.ports import ReaperStore
from service.saga_lapse import lapse_sagas
from service.saga_service import SagaService
from service.shared_lock_service import SharedLockService, expire_shared
from service.stopping import pause_unless_stopped

log = structlog.get_logger("lockledger.reaper")

EXPIRED_TOTAL = Counter("lockledger_leases_expired_total", "Leases expired by the reaper")
EXPIRY_LATENESS = Histogram(
    "lockledger_expiry_lateness_seconds",
    "Time from a lease's deadline to its LOCK_EXPIRED event",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
KEYS_PURGED_TOTAL = Counter("lockledger_idempotency_keys_purged_total", "Idempotency-Keys purged")
# How often a reaper asks for the partitions ahead: each call is a catalog read when they exist.
PARTITIONS_EVERY_S = 600.0
PARTITIONS_RETRY_S = 60.0


class Reaper:
    """Runs passes until stopped; sleeps only when a pass found less than a full batch."""

    def __init__(
        self,
        store: ReaperStore,
        sagas: SagaService,
        settings: Settings,
        reaper_id: str | None = None,
        outage_watch: OutageWatch | None = None,
        shared: SharedLockService | None = None,
    ) -> None:
        self._store = store
        self._sagas = sagas
        self._shared = shared
        self._settings = settings
        self.reaper_id = reaper_id or instance_id()
        # Nothing lapsed during an outage is expired before the outage's extension ran.
        self._outage_watch = outage_watch
        self._stop = asyncio.Event()
        self.expired_count = 0
        self.lapsed_count = 0
        self._next_purge = 0.0
        self._next_partitions = 0.0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        log.info("reaper started", reaper_id=self.reaper_id, batch=self._settings.reaper_batch_size)
        while not self._stop.is_set():
            try:
                found = await self.run_once()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as error:
                if self._outage_watch is not None:
                    self._outage_watch.saw_failure(error)
                log.warning("reaper pass failed; retrying", error=str(error))
                found = 0
            if found < self._settings.reaper_batch_size:
                await pause_unless_stopped(self._stop, self._settings.reaper_interval_ms / 1000)
        log.info(
            "reaper stopped", reaper_id=self.reaper_id, expired=self.expired_count, lapsed=self.lapsed_count
        )

    async def run_once(self) -> int:
        if self._outage_watch is not None:
            await self._outage_watch.resume_if_needed()
        settings = self._settings
        expiries = await self._store.expire_due(
            settings.reaper_batch_size,
            self.reaper_id,
            None if self._outage_watch is None else settings.outage_after_ms,
        )
        for expiry in expiries:
            EXPIRY_LATENESS.observe(max(expiry.lateness_s, 0.0))
        EXPIRED_TOTAL.inc(len(expiries))
        if expiries:
            self.expired_count += len(expiries)
            log.info(
                "leases expired",
                count=len(expiries),
                max_lateness_ms=round(max(e.lateness_s for e in expiries) * 1000, 1),
            )
        due = await self._store.due_sagas(settings.reaper_batch_size)
        if time.monotonic() >= self._next_purge:
            purged = await self._store.purge_keys(
                settings.idempotency_retention_s, settings.idempotency_purge_batch
            )
            KEYS_PURGED_TOTAL.inc(purged)
            await self._store.purge_tickets(settings.idempotency_purge_batch)
            # Keep purging without pause while there is a backlog; otherwise look again in 10 s.
            self._next_purge = 0.0 if purged >= settings.idempotency_purge_batch else time.monotonic() + 10
        lapsed = await lapse_sagas(self._sagas, due, self.reaper_id)
        self.lapsed_count += lapsed
        shared = 0
        if self._shared is not None:
            shared = await expire_shared(self._shared, settings.reaper_batch_size)
            EXPIRED_TOTAL.inc(shared)
            self.expired_count += shared
        if time.monotonic() >= self._next_partitions:
            await self._create_partitions()
        return max(len(expiries), len(due), shared)

    async def _create_partitions(self) -> None:
        """The log's partitions ahead. A refusal (a lock wait past the statement timeout, a database not
        migrated yet) is logged and tried again a minute later; it never holds up expiries."""
        settings = self._settings
        try:
            created = await self._store.create_partitions(
                settings.partition_interval, settings.partitions_ahead
            )
        except asyncpg.PostgresError as error:
            log.warning("creating event partitions failed; retrying in a minute", error=str(error))
            self._next_partitions = time.monotonic() + PARTITIONS_RETRY_S
            return
        if created:
            log.info("event partitions created", count=created, interval=settings.partition_interval)
        self._next_partitions = time.monotonic() + PARTITIONS_EVERY_S
