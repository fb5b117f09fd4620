"""Fault 4: the reaper is SIGKILLed while leases lapse, and restarted.

The server runs without its in-process reaper (``LOCKLEDGER_REAPER_ENABLED=false``); a standalone
`lockledger reaper` does the expiring. Clients walk away from most of their leases, so leases lapse all
the time. While the reaper is dead, a lapsed lease must still be taken over by the next acquire (which
expires it itself), renewals of lapsed leases must be refused, and no lease may overlap another; once a
reaper runs again it must expire every lapsed lease, never before its deadline."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest

from domain.events import LOCK_EXPIRED
from eventstore.dburl import asyncpg_dsn
from tests.faults.history import Audit, EventRecord, History
from tests.faults.load import MIN_ACKED, Load, LoadProfile
from tests.faults.postgres import PrivatePostgres
from tests.faults.processes import ReaperFactory, ServerFactory
from tests.faults.report import conclude

pytestmark = [pytest.mark.storage, pytest.mark.slow]

PROFILE = LoadProfile(clients=24, ttl_ms=(1_000, 1_500), max_renews=1, abandon=0.6)
QUIET_LEASE = {"owner": "loner", "ttl_ms": 1_000}


async def _wait_until_all_free(database_url: str, prefix: str, timeout_s: float) -> int:
    """Poll until no lease under ``prefix`` is held; returns how many still are at the timeout."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            held = await conn.fetchval(
                "SELECT count(*) FROM lock_state WHERE starts_with(resource, $1) AND status = 'held'", prefix
            )
            if held == 0 or time.monotonic() > deadline:
                return int(held)
            await asyncio.sleep(0.1)
    finally:
        await conn.close()


def _reaped(audit: Audit) -> list[EventRecord]:
    """LOCK_EXPIRED appended by a reaper (an acquire's own carries the acquire's Idempotency-Key)."""
    return [e for e in audit.events if e.event_type == LOCK_EXPIRED and e.key is None]


def _expiries(audit: Audit) -> dict[str, Any]:
    reaped = _reaped(audit)
    lateness = [(e.recorded_at - e.expires_at).total_seconds() for e in reaped if e.expires_at]
    return {
        "expired_by_reaper": len(reaped),
        "max_reaper_lateness_s": round(max(lateness, default=0.0), 2),
        "expired_by_acquire": sum(e.event_type == LOCK_EXPIRED and e.key is not None for e in audit.events),
    }


async def test_reaper_sigkill_and_restart(
    private_postgres: PrivatePostgres,
    unique_prefix: str,
    start_server: ServerFactory,
    start_reaper: ReaperFactory,
) -> None:
    # The private database: on the shared one, a session server's own reaper (the `server` fixture's) could
    # expire these leases too, and every expiry here must be the standalone reaper's.
    database_url = private_postgres.url
    started = time.monotonic()
    history = History()
    server, reaper = await asyncio.gather(
        asyncio.to_thread(start_server, database_url, {"LOCKLEDGER_REAPER_ENABLED": "false"}),
        asyncio.to_thread(start_reaper, database_url),
    )
    resources = [f"{unique_prefix}cart{i}" for i in range(12)]
    async with Load(server.base_url, resources, history, PROFILE, seed=4) as load:
        for round_, dead_s in enumerate((2.0, 1.5)):
            await asyncio.sleep(1.0)
            # Leases on resources nobody else asks for: no acquire will take them over, only a reaper
            # can end them, and they lapse while it is dead.
            await asyncio.gather(
                *(
                    load.command("loner", "acquire", f"{unique_prefix}quiet{round_}-{i}", QUIET_LEASE)
                    for i in range(4)
                )
            )
            history.fault("sigkill_reaper", f"dead for {dead_s} s")
            reaper.kill()
            await asyncio.sleep(dead_s)
            await asyncio.to_thread(reaper.start)
        await asyncio.sleep(1.0)
    still_held = await _wait_until_all_free(database_url, unique_prefix, timeout_s=5.0)

    audit = await conclude(
        "reaper SIGKILL",
        database_url,
        unique_prefix,
        history,
        started,
        notes_from=_expiries,
        reaper_starts=len(reaper.pids),
    )
    found = _expiries(audit)
    reaped = _reaped(audit)
    assert audit.violations == [], "\n".join(map(str, audit.violations))
    assert len(history.acked) > MIN_ACKED, "the load never got going"
    assert still_held == 0, f"{still_held} lapsed leases were never expired after the reaper restarted"
    assert reaped, "the reaper expired nothing"
    assert found["expired_by_acquire"] > 0, "no acquire took over a lapsed lease"
    # Only our standalone reapers expired leases: the server's own reaper was really off.
    assert {e.metadata.get("reaper_id") for e in reaped} <= reaper.reaper_ids
    assert found["max_reaper_lateness_s"] > 0.5, "no lease waited for the restarted reaper"
