"""Faults 7 and 8: every coordination primitive at once on two servers (tests/coordination_load.py),
while one server is SIGKILLed and restarted, or PostgreSQL is restarted (issue 35, item 6).

Agents mix waiting acquires (the fair queue), overlapping reservations, hand-offs accepted or declined,
readers and writers of a read/write lock and permits of a semaphore, renewals and releases; a command
whose outcome is unknown is retried under its Idempotency-Key on the other server. Whatever the fault cut
off, the log must keep every invariant of tests/invariants.py: never two holders of a mutex, a writer
alone and permits within the limit, tokens strictly increasing, each reservation one transaction of
exactly its set, no grant overtaking a waiter queued before it (a reader: a writer), and every
acknowledged command in the log once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from eventstore.dburl import asyncpg_dsn
from eventstore.verify import verify_chains
from tests.coordination_load import CoordinationLoad, Mix, QueueWatcher
from tests.faults.history import Audit, EventRecord, History, Violation
from tests.faults.load import MIN_ACKED
from tests.faults.postgres import PrivatePostgres
from tests.faults.processes import ServerFactory
from tests.faults.report import conclude
from tests.invariants import Judgement, LogEvent, contested, judge, read_log
from tests.servers import ServerProcess

pytestmark = [pytest.mark.storage, pytest.mark.slow]

SETTINGS = {"LOCKLEDGER_REAPER_INTERVAL_MS": "100", "LOCKLEDGER_MAX_WAIT_MS": "5000"}
MIX = Mix(cycles=None)  # until stopped
LOAD_S = 4.0  # before the fault, and again after the recovery


def _record(event: LogEvent) -> EventRecord:
    return EventRecord(
        event.stream,
        event.version,
        event.type,
        event.owner,
        event.token,
        event.expires_at,
        event.recorded_at,
        event.metadata,
    )


def _auditor(
    database_url: str, prefix: str, history: History, load: CoordinationLoad, watcher: QueueWatcher
) -> tuple[Callable[[], Awaitable[Audit]], list[Judgement]]:
    """The audit ``conclude`` runs: the log judged by tests/invariants.py, and every hash chain verified."""
    verdicts: list[Judgement] = []

    async def audit() -> Audit:
        conn = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            events = await read_log(conn, prefix)
            chains = await verify_chains(conn)
        finally:
            await conn.close()
        verdict = judge(events, history.operations, load.requested, watcher.tickets.values())
        verdicts.append(verdict)
        violations = list(verdict.violations)
        if chains.broken is not None:
            link = chains.broken
            violations.append(Violation("broken_chain", link.stream_id, f"v{link.version}: {link.reason}"))
        return Audit([_record(e) for e in events], chains, violations)

    return audit, verdicts


def _notes(
    history: History, load: CoordinationLoad, verdicts: list[Judgement], watcher: QueueWatcher
) -> dict[str, object]:
    events = verdicts[0].events if verdicts else []
    shared = [e for e in events if e.stream.startswith("shared/")]
    return {
        "acked_by_command": dict(load.done),
        "shared_grants": dict(load.granted),
        "shared_unknown": sum(op.command.startswith("shared-") for op in history.unknown),
        "tickets_seen": len(watcher.tickets),
        "contested_grants": contested(events, watcher.tickets.values()),
        "contested_shared_grants": contested(shared, watcher.tickets.values()),
    }


def _progress_after(history: History, since_mono: float) -> bool:
    return any(op.invoked_mono > since_mono for op in history.acked)


async def test_one_of_two_servers_sigkilled_under_every_primitive(
    database_url: str, unique_prefix: str, start_server: ServerFactory
) -> None:
    started = time.monotonic()
    history = History()
    servers: list[ServerProcess] = [start_server(database_url, SETTINGS) for _ in range(2)]
    load = CoordinationLoad([s.base_url for s in servers], unique_prefix, history, MIX, seed=8)
    async with QueueWatcher(database_url, unique_prefix) as watcher:
        await load.start()
        try:
            await asyncio.sleep(LOAD_S)
            killed = history.fault("sigkill_service", servers[1].base_url)
            servers[1].kill()
            await asyncio.to_thread(servers[1].start)
            downtime_s = round(time.monotonic() - killed.at_mono, 2)
            restarted = time.monotonic()
            await asyncio.sleep(LOAD_S)
        finally:
            await load.stop()

    audit, verdicts = _auditor(database_url, unique_prefix, history, load, watcher)
    result = await conclude(
        "coordination, one of two servers SIGKILLed",
        database_url,
        unique_prefix,
        history,
        started,
        audit_with=audit,
        notes_from=lambda _: _notes(history, load, verdicts, watcher),
        downtime_s=downtime_s,
        connect_errors=sum(op.error == "ConnectError" for op in history.unknown),
    )
    assert result.violations == [], "\n".join(map(str, result.violations))
    assert len(history.acked) > MIN_ACKED, "the load never got going"
    assert any(op.error for op in history.unknown), "no request noticed the kill"
    assert _progress_after(history, restarted), "no progress after the restart"
    for command in ("acquire", "handoff", "reserve", "shared-release"):
        assert load.done[command] > 0, (command, dict(load.done))
    for kind in ("read", "write", "permit"):
        assert load.granted[kind] > 0, (kind, dict(load.granted))


async def test_postgres_restarted_under_every_primitive(
    private_postgres: PrivatePostgres, unique_prefix: str, start_server: ServerFactory
) -> None:
    """A fast shutdown of the postmaster (transactions rolled back, clients disconnected), down 1 s."""
    started = time.monotonic()
    history = History()
    url = private_postgres.url
    servers = [start_server(url, SETTINGS) for _ in range(2)]
    load = CoordinationLoad([s.base_url for s in servers], unique_prefix, history, MIX, seed=9)
    async with QueueWatcher(url, unique_prefix) as watcher:
        await load.start()
        try:
            await asyncio.sleep(LOAD_S)
            history.fault("postgres_stop_fast")
            await asyncio.to_thread(private_postgres.stop_postmaster, "fast")
            await asyncio.sleep(1.0)
            await asyncio.to_thread(private_postgres.start_postmaster)
            restarted = time.monotonic()
            await asyncio.sleep(LOAD_S + 1.0)
        finally:
            await load.stop()

    audit, verdicts = _auditor(url, unique_prefix, history, load, watcher)
    result = await conclude(
        "coordination, PostgreSQL restarted",
        url,
        unique_prefix,
        history,
        started,
        audit_with=audit,
        notes_from=lambda _: _notes(history, load, verdicts, watcher),
        unavailable_503=sum(op.status == 503 for op in history.unknown),
        internal_errors_500=sum(op.status == 500 for op in history.operations),
    )
    assert result.violations == [], "\n".join(map(str, result.violations))
    assert not any(op.status == 500 for op in history.operations)
    assert len(history.acked) > MIN_ACKED, "the load never got going"
    assert history.unknown, "the outage went unnoticed"
    assert _progress_after(history, restarted), "the service did not recover"
    for command in ("acquire", "handoff", "reserve", "shared-release"):
        assert load.done[command] > 0, (command, dict(load.done))
    for kind in ("read", "write", "permit"):
        assert load.granted[kind] > 0, (kind, dict(load.granted))
