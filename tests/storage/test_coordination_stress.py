"""Every coordination primitive at once, through HTTP on two real servers sharing one database, with
every invariant checked on the log (tests/invariants.py; issue 35, item 6).

Agents mix single acquires that wait in the fair queue, reservations of overlapping routes, hand-offs
between agents (offered, then accepted or declined), readers and writers of a read/write lock and
permits of a semaphore (waiting too), renewals and releases, each request on either server
(tests/coordination_load.py). Then the log, read in position order, must show: never two holders of a
mutex, a writer alone and never more permits than the limit, tokens strictly increasing per resource,
every reservation granted in one transaction and exactly its set, no grant overtaking a waiter queued
before it (a reader: a writer), and every acknowledged command in it.
"""

from __future__ import annotations

from collections.abc import Iterator

import asyncpg
import pytest

from eventstore.dburl import asyncpg_dsn
from tests.coordination_load import CoordinationLoad, Mix, QueueWatcher
from tests.faults.history import History
from tests.faults.load import MIN_ACKED
from tests.invariants import contested, judge, read_log
from tests.servers import ServerProcess, running_server

pytestmark = pytest.mark.storage

SETTINGS = {"LOCKLEDGER_REAPER_INTERVAL_MS": "100", "LOCKLEDGER_MAX_WAIT_MS": "5000"}
GUARD_S = 120.0


@pytest.fixture(scope="module")
def two_servers(database_url: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with running_server(database_url, SETTINGS) as first, running_server(database_url, SETTINGS) as second:
        yield first, second


async def test_two_servers_under_every_primitive_keep_every_invariant(
    two_servers: tuple[ServerProcess, ServerProcess], database_url: str, unique_prefix: str
) -> None:
    history = History()
    load = CoordinationLoad([s.base_url for s in two_servers], unique_prefix, history, Mix(), seed=7)
    async with QueueWatcher(database_url, unique_prefix) as watcher:
        await load.start()
        await load.finish(GUARD_S)
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        events = await read_log(conn, unique_prefix)
    finally:
        await conn.close()

    verdict = judge(events, history.operations, load.requested, watcher.tickets.values())
    shared = [e for e in events if e.stream.startswith("shared/")]
    print(
        f"\ncoordination stress: {len(history.operations)} requests, {len(history.acked)} acked,"
        f" {len(history.unknown)} unknown; contested grants {contested(events, watcher.tickets.values())}"
        f" (shared {contested(shared, watcher.tickets.values())}); shared grants {dict(load.granted)};"
        f" {len(verdict.violations)} violations"
    )

    assert verdict.violations == [], "\n".join(map(str, verdict.violations))
    # Not vacuous: every primitive was used and acknowledged, and waiters were served through the queue.
    for command in ("acquire", "renew", "release", "handoff", "accept", "decline", "reserve"):
        assert load.done[command] > 0, (command, dict(load.done))
    for command in ("reserve-release", "shared-renew", "shared-release"):
        assert load.done[command] > 0, (command, dict(load.done))
    for kind in ("read", "write", "permit"):
        assert load.granted[kind] > 0, (kind, dict(load.granted))
    for grants in (events, shared):
        assert any(e.metadata.get("queue_ticket") is not None for e in grants), "no grant through the queue"
        assert contested(grants, watcher.tickets.values()) > 0, "no grant was decided while others queued"
    assert len(history.acked) > MIN_ACKED
