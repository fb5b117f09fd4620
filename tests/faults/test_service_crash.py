"""Fault 1: the service is SIGKILLed twice under load and restarted on the same port.

Requests in flight die with their connection; clients retry them under the same Idempotency-Key once the
server is back. Whatever the kill cut off, every acknowledged command must be in the log exactly once,
no retry may apply a command a second time, and leases must never overlap.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.faults.history import History
from tests.faults.load import MIN_ACKED, Load, LoadProfile
from tests.faults.processes import ServerFactory
from tests.faults.report import conclude

pytestmark = [pytest.mark.storage, pytest.mark.slow]

KILLS = 2
SECONDS_BETWEEN_KILLS = 1.5


async def test_service_sigkill_and_restart(
    database_url: str, unique_prefix: str, start_server: ServerFactory
) -> None:
    started = time.monotonic()
    history = History()
    downtimes: list[float] = []
    server = start_server(database_url)
    resources = [f"{unique_prefix}crate{i}" for i in range(12)]
    async with Load(server.base_url, resources, history, LoadProfile(clients=24), seed=1):
        for _ in range(KILLS):
            await asyncio.sleep(SECONDS_BETWEEN_KILLS)
            killed = history.fault("sigkill_service")
            server.kill()
            await asyncio.to_thread(server.start)
            downtimes.append(round(time.monotonic() - killed.at_mono, 2))
        last_restart = time.monotonic()
        await asyncio.sleep(SECONDS_BETWEEN_KILLS)

    # Requests in flight at a kill: sent before it, their connection broken after it.
    cut_off = [
        op
        for op in history.unknown
        if op.error not in (None, "ConnectError")
        and any(op.invoked_mono <= f.at_mono <= (op.completed_mono or 0.0) for f in history.faults)
    ]
    refused_connections = sum(op.error == "ConnectError" for op in history.unknown)
    retried = [op for op in history.acked if op.attempt > 1]
    audit = await conclude(
        "service SIGKILL",
        database_url,
        unique_prefix,
        history,
        started,
        cut_off_requests=len(cut_off),
        connect_errors=refused_connections,
        acked_retries=len(retried),
        replayed_retries=sum(op.replayed for op in retried),
        downtime_s=downtimes,
    )
    assert audit.violations == [], "\n".join(map(str, audit.violations))
    assert len(history.acked) > MIN_ACKED, "the load never got going"
    # Most agents are between commands at any instant, so few requests are in flight at the kill
    # itself (reported above); every agent then meets the dead server.
    assert any(op.error for op in history.unknown), "no request noticed the kills"
    assert any(op.invoked_mono > last_restart for op in history.acked), "no progress after the restart"
