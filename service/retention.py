"""Retention: partitions of the log older than ``retention_days`` archived to files on a schedule.

Every ``retention_interval_s`` a pass archives each partition whose range ended more than
``retention_days`` ago into ``archive_dir`` (``eventstore/archive.py``: the file is written and proved
whole before the partition is dropped). One instance at a time: a pass that finds the session advisory
lock taken by another instance leaves the work to it. The pass runs as ``lockledger_migrator``, the
role that may drop partitions, on a pool of one connection it opens for the pass and closes after, so
the server's own pools never hold that role.

A failed pass (the directory not writable, a lock not granted within ``LOCK_TIMEOUT``) is logged and
tried again at the next interval; it never stops the server.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import structlog
from prometheus_client import Counter

from eventstore.archive import MIGRATOR_ROLE, ArchiveRecord, archive_before
from service.config import Settings
from service.database import create_pool
from service.stopping import pause_unless_stopped

log = structlog.get_logger("lockledger.retention")

PARTITIONS_ARCHIVED_TOTAL = Counter(
    "lockledger_partitions_archived_total", "Log partitions archived to files"
)
EVENTS_ARCHIVED_TOTAL = Counter("lockledger_events_archived_total", "Events archived to files")
RETENTION_FAILURES_TOTAL = Counter("lockledger_retention_failures_total", "Retention passes that failed")
LOCK_KEY = "lockledger.retention"


class Retention:
    """The schedule; :meth:`run` until :meth:`stop`, or one :meth:`run_once`."""

    def __init__(self, settings: Settings) -> None:
        if settings.retention_days is None or settings.archive_dir is None:
            raise ValueError("retention needs retention_days and archive_dir")
        self._settings = settings
        self._days = settings.retention_days
        self._directory = Path(settings.archive_dir)
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        log.info("retention started", days=self._days, directory=str(self._directory))
        while not self._stop.is_set():
            try:
                await self.run_once()
            except Exception as error:  # a pass that fails is tried again at the next interval
                RETENTION_FAILURES_TOTAL.inc()
                log.warning("retention pass failed", error=str(error), error_type=type(error).__name__)
            await pause_unless_stopped(self._stop, self._settings.retention_interval_s)
        log.info("retention stopped")

    async def run_once(self, now: datetime | None = None) -> list[ArchiveRecord]:
        """Archive what is due now; the partitions archived (none when another instance holds the lock)."""
        before = (now or datetime.now(UTC)) - timedelta(days=self._days)
        pool = await create_pool(self._settings, role=MIGRATOR_ROLE, max_size=1)
        try:
            async with pool.acquire() as conn:
                await conn.execute("SET statement_timeout = 0")  # a partition's read may take minutes
                if not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", LOCK_KEY):
                    return []
                try:
                    done = await archive_before(conn, before, self._directory)
                finally:
                    await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", LOCK_KEY)
        finally:
            await pool.close()
        for record in done:
            PARTITIONS_ARCHIVED_TOTAL.inc()
            EVENTS_ARCHIVED_TOTAL.inc(record.events)
            log.info(
                "partition archived",
                partition=record.partition,
                events=record.events,
                file=record.file_name,
                sha256=record.content_sha256,
            )
        return done
