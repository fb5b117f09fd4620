"""The saga use case and the reaper's pass on the in-memory fakes (the contract suite holds the PostgreSQL
adapters to the same ports): a saga's instants and lease from the store's clock, Idempotency-Keys
replayed or refused, a saga whose orchestrator stopped heartbeating compensated and then stuck, leases
expired only once lapsed, and a purged key decided afresh. Time passes only when a test moves the clock.
"""

from __future__ import annotations

from datetime import timedelta

import asyncpg
import pytest

from domain.commands import Acquire
from domain.errors import LockHeld
from domain.resource import TtlBounds
from domain.saga import (
    CompleteSaga,
    CompleteStep,
    RenewSagaLease,
    SagaConflict,
    StartSaga,
    StartStep,
    StepDef,
)
from domain.timestamps import format_timestamp
from service.clock import SettableClock
from service.config import Settings
from service.errors import IdempotencyKeyReused
from service.fakes.database import MemoryDatabase
from service.fakes.reaper_store import MemoryReaperStore
from service.lock_service import CommandContext
from service.reaper import Reaper
from service.saga_service import SagaContext, SagaService
from tests.assertions import granted
from tests.in_memory import lock_service_in_memory, reaper_in_memory, saga_service_in_memory

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)
SETTINGS = Settings(reaper_enabled=False)
STEPS = (StepDef("pick", ("pallet:42",)), StepDef("drive", ("zone:A3",)))
AGENT = SagaContext(principal="bot1")


@pytest.fixture
def sagas(database: MemoryDatabase) -> SagaService:
    return saga_service_in_memory(database)


def _start(saga_id: str, lease_ms: int | None = 1_000) -> StartSaga:
    return StartSaga(saga_id, "move", "bot1", STEPS, lease_ms=lease_ms)


async def test_a_saga_runs_to_completion_stamped_by_the_store_clock(
    sagas: SagaService, clock: SettableClock
) -> None:
    started_at = format_timestamp(clock.now())
    created = await sagas.execute(_start("s1"), AGENT)
    assert created.created
    assert created.changed
    assert (created.view["status"], created.view["version"]) == ("running", 1)
    assert created.view["started_at"] == created.view["updated_at"] == started_at
    assert created.view["lease_expires_at"] == format_timestamp(clock.now() + timedelta(seconds=1))
    for step in ("pick", "drive"):
        clock.advance(0.5)  # each transition renews the lease
        await sagas.execute(StartStep("s1", step), AGENT)
        await sagas.execute(CompleteStep("s1", step, '{"ok": true}'), AGENT)
    done = await sagas.execute(CompleteSaga("s1"), AGENT)
    assert (done.view["status"], done.view["version"]) == ("completed", 6)
    assert done.view["started_at"] == started_at
    assert done.view["updated_at"] == format_timestamp(clock.now())
    assert done.view["lease_expires_at"] is None  # a finished saga holds no lease
    assert [step["result"] for step in done.view["steps"]] == [{"ok": True}, {"ok": True}]


async def test_a_transition_that_already_happened_appends_nothing(
    sagas: SagaService, database: MemoryDatabase
) -> None:
    await sagas.execute(_start("s1"), AGENT)
    again = await sagas.execute(_start("s1"), AGENT)
    assert not again.changed
    assert again.view["version"] == 1
    assert len(database.saga_events["saga/s1"]) == 1


async def test_a_key_replays_its_answer_and_refuses_another_request(
    sagas: SagaService, database: MemoryDatabase
) -> None:
    keyed = SagaContext(principal="bot1", idempotency_key="k1")
    first = await sagas.execute(_start("s1"), keyed)
    replayed = await sagas.execute(_start("s1"), keyed)
    assert replayed.replayed
    assert replayed.view == first.view
    with pytest.raises(IdempotencyKeyReused):
        await sagas.execute(StartStep("s1", "pick"), keyed)
    assert len(database.saga_events["saga/s1"]) == 1


async def test_heartbeats_keep_a_saga_from_lapsing(
    sagas: SagaService, database: MemoryDatabase, clock: SettableClock
) -> None:
    reaper = reaper_in_memory(database, SETTINGS)
    await sagas.execute(_start("s1"), AGENT)
    for _ in range(5):
        clock.advance(0.9)
        await sagas.execute(RenewSagaLease("s1"), AGENT)
        await reaper.run_once()
    assert reaper.lapsed_count == 0
    loaded = await sagas.execute(RenewSagaLease("s1"), AGENT)
    assert loaded.view["status"] == "running"


async def test_a_saga_whose_heartbeats_stop_is_compensated_then_stuck(
    sagas: SagaService, database: MemoryDatabase, clock: SettableClock
) -> None:
    reaper = reaper_in_memory(database, SETTINGS)
    await sagas.execute(_start("s1"), AGENT)
    await sagas.execute(StartStep("s1", "pick"), AGENT)
    await sagas.execute(CompleteStep("s1", "pick", '{"from": "dock:3"}'), AGENT)
    await sagas.execute(StartStep("s1", "drive"), AGENT)
    clock.advance(0.999)
    assert await reaper.run_once() == 0  # not yet due
    clock.advance(0.001)  # the deadline itself is too late
    assert await reaper.run_once() == 1
    lapsed = database.sagas["s1"]
    assert lapsed.state.status == "compensating"
    assert [step.status for step in lapsed.state.steps] == ["completed", "failed"]
    assert lapsed.lease_lapsed_at == clock.now()
    assert lapsed.state.lease_expires_at is not None
    assert lapsed.state.lease_expires_at > clock.now()  # another lease to compensate in
    assert [event.type for event in database.saga_events["saga/s1"]][-2:] == [
        "SAGA_LEASE_EXPIRED",
        "STEP_FAILED",
    ]
    clock.advance(1)  # nobody compensated
    await reaper.run_once()
    stuck = database.sagas["s1"].state
    assert stuck.status == "stuck"
    assert stuck.lease_expires_at is None
    assert reaper.lapsed_count == 2
    with pytest.raises(SagaConflict):
        await sagas.execute(RenewSagaLease("s1"), AGENT)


async def test_the_reaper_expires_lapsed_leases_only(database: MemoryDatabase, clock: SettableClock) -> None:
    service = lock_service_in_memory(database, BOUNDS)
    reaper = reaper_in_memory(database, SETTINGS)
    short = granted(await service.execute(Acquire("zone:short", "bot1", 1_000), CommandContext()))
    await service.execute(Acquire("zone:long", "bot2", 60_000), CommandContext())
    clock.advance(1)
    assert await reaper.run_once() == 1
    assert reaper.expired_count == 1
    assert [event.type for event in database.events["zone:short"]] == ["LOCK_ACQUIRED", "LOCK_EXPIRED"]
    assert [event.type for event in database.events["zone:long"]] == ["LOCK_ACQUIRED"]
    taken = granted(await service.execute(Acquire("zone:short", "bot3", 1_000), CommandContext()))
    assert taken.fencing_token > short.fencing_token  # never resurrected: a new lease, a higher token
    await service.close()


class _PartitionsRefused(MemoryReaperStore):
    """A database that refuses to create partitions, and counts how often it was asked."""

    asked = 0

    async def create_partitions(self, interval: str, ahead: int) -> int:
        self.asked += 1
        raise asyncpg.LockNotAvailableError("lock timeout")


async def test_a_refused_partition_creation_holds_up_no_expiry(
    database: MemoryDatabase, clock: SettableClock
) -> None:
    service = lock_service_in_memory(database, BOUNDS)
    store = _PartitionsRefused(database)
    reaper = Reaper(store, saga_service_in_memory(database), SETTINGS)
    await service.execute(Acquire("zone:a", "bot1", 1_000), CommandContext())
    clock.advance(1)
    assert await reaper.run_once() == 1
    await service.execute(Acquire("zone:b", "bot1", 1_000), CommandContext())
    clock.advance(1)
    assert await reaper.run_once() == 1  # expired again; not asked again within the minute
    assert store.asked == 1
    assert [event.type for event in database.events["zone:b"]] == ["LOCK_ACQUIRED", "LOCK_EXPIRED"]
    await service.close()


async def test_a_purged_key_is_decided_afresh(database: MemoryDatabase, clock: SettableClock) -> None:
    service = lock_service_in_memory(database, BOUNDS)
    retention = Settings(reaper_enabled=False, idempotency_retention_s=60)
    reaper = reaper_in_memory(database, retention)
    ctx = CommandContext(principal="bot1", idempotency_key="k1")
    command = Acquire("zone:A3", "bot1", 600_000)
    await service.execute(command, ctx)
    clock.advance(59)
    await reaper.run_once()
    assert (await service.execute(command, ctx)).replayed  # kept within the retention
    clock.advance(2)
    reaper = reaper_in_memory(database, retention)  # a new reaper purges at its first pass
    await reaper.run_once()
    # The key is forgotten: the same request is decided afresh (a lock is not re-entrant), not replayed.
    with pytest.raises(LockHeld):
        await service.execute(command, ctx)
    await service.close()
