"""Sagas under faults: several orchestrators run pallet -> zone sagas (some fail on purpose, some wait
for a zone that stays occupied) while the service is SIGKILLed and restarted, and while PostgreSQL is
restarted.

An orchestrator that meets an error the SDK's retries could not hide leaves that saga to
``recover_sagas``, which it calls for its own agent before its next saga and, once the faults are over,
one last time. Then, for every saga: it ended ``completed`` or ``aborted`` (none left running,
compensating or stuck); every completed step of an aborted saga was compensated exactly once, last
completed first; no step started after a failure or an abort request; no effect was undone twice and
each compensation got the result its step recorded; every saga and lock stream of the scenario
verifies as a hash chain; and no lock under the scenario's prefix is left held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest
import stamina

from tests.faults.postgres import PrivatePostgres
from tests.faults.processes import ServerFactory
from tests.faults.saga_load import SagaAudit, SagaLoad, audit_sagas
from tests.faults.test_database_faults import DOWN_S

pytestmark = [pytest.mark.storage, pytest.mark.slow]

KILLS = 2
SECONDS_BETWEEN_FAULTS = 2.0
ORCHESTRATORS = 6


@contextlib.contextmanager
def _retries_seen() -> Iterator[list[BaseException]]:
    """What the SDK's retries were caused by, while the block runs (stamina's hooks, restored after)."""
    seen: list[BaseException] = []
    before = stamina.instrumentation.get_on_retry_hooks()

    def note(details: stamina.instrumentation.RetryDetails) -> None:
        seen.append(details.caused_by)

    stamina.instrumentation.set_on_retry_hooks([*before, note])
    try:
        yield seen
    finally:
        stamina.instrumentation.set_on_retry_hooks(before)


def _assert_sound(
    scenario: str, load: SagaLoad, audit: SagaAudit, started: float, retried: list[BaseException]
) -> None:
    print(f"\n{scenario}: {audit.summary(load)}; {time.monotonic() - started:.1f} s")
    for violation in audit.violations[:50]:
        print(f"  VIOLATION {violation}")
    assert audit.violations == [], "\n".join(audit.violations)
    assert audit.held == []
    assert audit.count("completed") > 0, "no saga completed"
    assert audit.compensated_steps > 0, "no compensation ran"
    # The faults reached the workload: an orchestrator saw an error, or its SDK retried through one.
    assert load.errors or retried, "no orchestrator noticed the faults"
    # How many sagas recover_sagas had to finish depends on where the faults cut in (reported above):
    # an error at a saga's start leaves nothing to recover, so it is not asserted.


async def test_sagas_survive_service_sigkill_and_restart(
    database_url: str, unique_prefix: str, start_server: ServerFactory
) -> None:
    started = time.monotonic()
    server = start_server(database_url)
    load = SagaLoad(server.base_url, unique_prefix, ORCHESTRATORS, seed=1)
    with _retries_seen() as retried:
        async with load:
            for _ in range(KILLS):
                await asyncio.sleep(SECONDS_BETWEEN_FAULTS)
                server.kill()
                await asyncio.to_thread(server.start)
            restarted_at = len(load.saga_ids)
            await asyncio.sleep(SECONDS_BETWEEN_FAULTS)
    audit = await audit_sagas(load, database_url)
    _assert_sound("sagas under service SIGKILL", load, audit, started, retried)
    after = [s for s in load.saga_ids[restarted_at:] if audit.views.get(s) is not None]
    assert any(audit.views[s].status in ("completed", "aborted") for s in after), "no saga after restart"


async def test_sagas_survive_postgres_restart(
    private_postgres: PrivatePostgres, unique_prefix: str, start_server: ServerFactory
) -> None:
    """A fast shutdown, then an immediate one (a crash: the next start replays the WAL)."""
    started = time.monotonic()
    server = start_server(private_postgres.url)
    load = SagaLoad(server.base_url, unique_prefix, ORCHESTRATORS, seed=2)
    with _retries_seen() as retried:
        async with load:
            for mode in ("fast", "immediate"):
                await asyncio.sleep(SECONDS_BETWEEN_FAULTS)
                await asyncio.to_thread(private_postgres.stop_postmaster, mode)
                await asyncio.sleep(DOWN_S)
                await asyncio.to_thread(private_postgres.start_postmaster)
            await asyncio.sleep(SECONDS_BETWEEN_FAULTS)
    audit = await audit_sagas(load, private_postgres.url)
    _assert_sound("sagas under PostgreSQL restart", load, audit, started, retried)
