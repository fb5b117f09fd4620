"""One contract per port (``service/ports.py``), each run against its in-memory fake and its PostgreSQL
adapter: the lock store, the saga store, the reaper's store and the notifier, with the clock they read.

Every test runs against both (the PostgreSQL run is a storage test). Time passes by the store's own
clock: the fakes' settable clock is moved by hand, PostgreSQL's by sleeping past a short lease. These
tests are what entitle the fakes to stand in for PostgreSQL in behaviour tests; the use case
(``LockService``) then runs over the memory store with and without the adapters.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest

from domain.commands import Accept, Acquire, Command, HandOff, Release, Renew
from domain.decider import decide
from domain.errors import LeaseExpired, LockHeld
from domain.resource import TtlBounds
from domain.saga import (
    AbortSaga,
    ExpireSagaLease,
    SagaCommand,
    SagaState,
    StartSaga,
    StartStep,
    StepDef,
    stream_id,
)
from domain.saga import decide as decide_saga
from domain.saga import fold as fold_saga
from domain.state import LockState
from domain.timestamps import format_timestamp
from service.clock import SettableClock
from service.database_guard import DatabaseGuard
from service.fakes.database import MemoryDatabase
from service.fakes.lock_store import MemoryLockStore
from service.fakes.notifier import MemoryNotifier
from service.fakes.reaper_store import MemoryReaperStore
from service.fakes.saga_store import MemorySagaStore
from service.idempotency import fingerprint
from service.lock_service import CommandContext, LockService, append_plan
from service.notifier import PostgresNotifier
from service.outcomes import Granted, Released
from service.ports import (
    AppendPlan,
    CommitConflict,
    Idempotency,
    LoadRequest,
    LockStore,
    Notifier,
    ReaperStore,
    SagaPlan,
    SagaStore,
)
from service.reaper_store import PostgresReaperStore
from service.saga_store import PostgresSagaStore
from service.store import PostgresStore
from service.store_adapters import InFlightOrdering, Remembering
from service.waiters import Waiters
from tests.assertions import granted

SHORT_MS = 50  # a lease that lapses within the test
BOUNDS = TtlBounds(min_ms=10, max_ms=60_000, default_ms=30_000)


Pass = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class Ports:
    """Every port on one store (the fakes share one ``MemoryDatabase``, the adapters one database),
    and how to let time pass by that store's clock."""

    locks: LockStore
    sagas: SagaStore
    reaper: ReaperStore
    notifier: Notifier
    pass_time: Pass


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.storage)])
def ports(request: pytest.FixtureRequest) -> Ports:
    if request.param == "memory":
        clock = SettableClock()
        database = MemoryDatabase(clock)

        async def advance(seconds: float) -> None:
            clock.advance(seconds)

        return Ports(
            MemoryLockStore(database),
            MemorySagaStore(database),
            MemoryReaperStore(database),
            MemoryNotifier(database),
            advance,
        )
    pool = request.getfixturevalue("own_service_pool")
    return Ports(
        PostgresStore(pool, acquire_timeout_s=5.0),
        PostgresSagaStore(pool, acquire_timeout_s=5.0),
        PostgresReaperStore(pool, acquire_timeout_s=5.0),
        PostgresNotifier(pool, acquire_timeout_s=5.0),
        asyncio.sleep,
    )


@pytest.fixture
def store_and_time(ports: Ports) -> tuple[LockStore, Pass]:
    return ports.locks, ports.pass_time


def _resource() -> str:
    return f"contract:{uuid.uuid4().hex[:12]}"


async def _load(store: LockStore, resource: str, key: str | None = None) -> tuple[LockState, datetime]:
    [snapshot] = await store.load([LoadRequest(resource, "agent", key)])
    return snapshot.state, snapshot.db_now


def _plan(state: LockState, command: Command, now: datetime, key: str | None = None) -> AppendPlan:
    idempotency = Idempotency("agent", key, fingerprint("test", command.resource, {}))
    events = decide(state, command, now, BOUNDS)
    plan = append_plan(command, state, events, {"command": "test"}, idempotency)
    assert plan is not None
    return plan


async def test_a_lock_never_seen_loads_free_at_version_0(store_and_time: tuple[LockStore, Pass]) -> None:
    store, _ = store_and_time
    [snapshot] = await store.load([LoadRequest(_resource(), "agent", "k")])
    assert snapshot.state.version == 0
    assert snapshot.state.status == "free"
    assert snapshot.stored is None
    assert snapshot.db_now.tzinfo is not None


async def test_a_grant_gets_its_deadline_from_the_store_clock(store_and_time: tuple[LockStore, Pass]) -> None:
    store, _ = store_and_time
    resource = _resource()
    state, before = await _load(store, resource)
    [committed] = await store.commit([_plan(state, Acquire(resource, "bot1", 30_000), before)])
    assert committed is not None
    assert committed.expires_at is not None
    assert committed.expires_at >= before + timedelta(milliseconds=30_000)
    held, after = await _load(store, resource)
    assert committed.expires_at <= after + timedelta(milliseconds=30_000)
    assert (held.version, held.status, held.owner, held.fencing_token) == (1, "held", "bot1", 1)
    assert held.expires_at == committed.expires_at


async def test_a_plan_on_a_moved_stream_writes_nothing(store_and_time: tuple[LockStore, Pass]) -> None:
    store, _ = store_and_time
    resource = _resource()
    state, now = await _load(store, resource)
    first = _plan(state, Acquire(resource, "bot1", 30_000), now)
    second = _plan(state, Acquire(resource, "bot2", 30_000), now)
    assert (await store.commit([first]))[0] is not None
    assert await store.commit([second]) == [None]
    held, _ = await _load(store, resource)
    assert (held.version, held.owner) == (1, "bot1")


async def test_a_renew_that_arrives_after_the_deadline_is_refused(
    store_and_time: tuple[LockStore, Pass],
) -> None:
    store, pass_time = store_and_time
    resource = _resource()
    state, now = await _load(store, resource)
    await store.commit([_plan(state, Acquire(resource, "bot1", SHORT_MS), now)])
    held, now = await _load(store, resource)
    renew = _plan(held, Renew(resource, "bot1", 1, 30_000), now)  # decided while the lease was live
    await pass_time(SHORT_MS / 1000 * 2)
    assert await store.commit([renew]) == [None]
    after, later = await _load(store, resource)
    assert after == held  # nothing renewed it (and no reaper works on this database)
    with pytest.raises(LeaseExpired):
        decide(after, Release(resource, "bot1", 1), later, BOUNDS)


async def test_a_hand_off_is_stored_as_a_grant_awaiting_acceptance(
    store_and_time: tuple[LockStore, Pass],
) -> None:
    store, _ = store_and_time
    resource = _resource()
    state, now = await _load(store, resource)
    await store.commit([_plan(state, Acquire(resource, "bot1", 30_000), now)])
    held, before = await _load(store, resource)
    [committed] = await store.commit([_plan(held, HandOff(resource, "bot1", 1, "bot2", 5_000), before)])
    assert committed is not None
    assert committed.expires_at is not None
    assert committed.expires_at >= before + timedelta(milliseconds=5_000)
    handed, now = await _load(store, resource)
    assert (handed.version, handed.owner, handed.fencing_token, handed.ttl_ms) == (2, "bot2", 2, 5_000)
    assert (handed.handed_off_by, handed.expires_at) == ("bot1", committed.expires_at)
    await store.commit([_plan(handed, Accept(resource, "bot2", 30_000), now)])
    accepted, _ = await _load(store, resource)
    assert (accepted.version, accepted.owner, accepted.handed_off_by, accepted.ttl_ms) == (
        3,
        "bot2",
        None,
        30_000,
    )


async def test_a_hand_off_that_arrives_after_the_deadline_is_refused(
    store_and_time: tuple[LockStore, Pass],
) -> None:
    store, pass_time = store_and_time
    resource = _resource()
    state, now = await _load(store, resource)
    await store.commit([_plan(state, Acquire(resource, "bot1", SHORT_MS), now)])
    held, now = await _load(store, resource)
    hand_off = _plan(held, HandOff(resource, "bot1", 1, "bot2", 30_000), now)  # decided while live
    await pass_time(SHORT_MS / 1000 * 2)
    assert await store.commit([hand_off]) == [None]
    assert (await _load(store, resource))[0] == held


async def test_a_key_keeps_the_answer_and_refuses_a_second_commit(
    store_and_time: tuple[LockStore, Pass],
) -> None:
    store, _ = store_and_time
    resource, other = _resource(), _resource()
    key = uuid.uuid4().hex
    state, now = await _load(store, resource)
    [committed] = await store.commit([_plan(state, Acquire(resource, "bot1", 30_000), now, key)])
    assert committed is not None
    [snapshot] = await store.load([LoadRequest(resource, "agent", key)])
    assert snapshot.stored is not None
    stored = json.loads(snapshot.stored.response)  # the answer's fields, its deadline stamped in
    assert committed.expires_at is not None
    assert stored["expires_at"] == format_timestamp(committed.expires_at)
    assert (stored["resource"], stored["fencing_token"]) == (resource, 1)
    other_state, now = await _load(store, other)
    with pytest.raises(CommitConflict):
        await store.commit([_plan(other_state, Acquire(other, "bot1", 30_000), now, key)])
    untouched, _ = await _load(store, other)
    assert untouched.version == 0


async def test_each_plan_of_a_batch_stands_or_falls_on_its_own(
    store_and_time: tuple[LockStore, Pass],
) -> None:
    store, _ = store_and_time
    fresh, stale = _resource(), _resource()
    state, now = await _load(store, stale)
    await store.commit([_plan(state, Acquire(stale, "bot1", 30_000), now)])
    fresh_state, now = await _load(store, fresh)
    plans = [
        _plan(fresh_state, Acquire(fresh, "bot1", 30_000), now),
        _plan(state, Acquire(stale, "bot2", 30_000), now),  # decided on version 0, now 1
    ]
    first, second = await store.commit(plans)
    assert first is not None
    assert second is None
    assert (await _load(store, fresh))[0].owner == "bot1"
    assert (await _load(store, stale))[0].owner == "bot1"


async def test_the_store_clock_never_runs_backwards(store_and_time: tuple[LockStore, Pass]) -> None:
    store, pass_time = store_and_time
    resource = _resource()
    state, first = await _load(store, resource)
    [committed] = await store.commit([_plan(state, Acquire(resource, "bot1", 30_000), first)])
    await pass_time(0.01)
    _, second = await _load(store, resource)
    assert committed is not None
    assert committed.expires_at is not None
    assert first <= committed.expires_at - timedelta(milliseconds=30_000) <= second
    assert first < second


# --- the notifier -----------------------------------------------------------------------------------


async def _hold(ports: Ports, resource: str, ttl_ms: int) -> LockState:
    state, now = await _load(ports.locks, resource)
    [committed] = await ports.locks.commit([_plan(state, Acquire(resource, "bot1", ttl_ms), now)])
    assert committed is not None
    return (await _load(ports.locks, resource))[0]


async def test_the_notifier_names_freed_and_lapsed_locks_only(ports: Ports) -> None:
    released, lapsing, live, never_seen = _resource(), _resource(), _resource(), _resource()
    held = await _hold(ports, released, 30_000)
    _, now = await _load(ports.locks, released)
    await ports.locks.commit([_plan(held, Release(released, "bot1", held.fencing_token), now)])
    await _hold(ports, lapsing, SHORT_MS)
    await _hold(ports, live, 30_000)
    assert set(await ports.notifier.freed([live, never_seen])) == set()
    await ports.pass_time(SHORT_MS / 1000 * 2)
    assert set(await ports.notifier.freed([released, lapsing, live, never_seen])) == {released, lapsing}


# --- the reaper's store -----------------------------------------------------------------------------


async def _expire_all(reaper: ReaperStore) -> set[str]:
    """Every lapsed lease expired, pass after pass (other tests' leases may share the database)."""
    expired: set[str] = set()
    while batch := await reaper.expire_due(100, "contract", None):
        expired |= {expiry.resource for expiry in batch}
        for expiry in batch:
            assert expiry.expired_at >= expiry.deadline
    return expired


async def test_the_reaper_expires_lapsed_leases_and_leaves_live_ones(ports: Ports) -> None:
    lapsing, live = _resource(), _resource()
    lapsing_held = await _hold(ports, lapsing, SHORT_MS)
    live_held = await _hold(ports, live, 30_000)
    await ports.pass_time(SHORT_MS / 1000 * 2)
    expired = await _expire_all(ports.reaper)
    assert lapsing in expired
    assert live not in expired
    after, now = await _load(ports.locks, lapsing)
    assert (after.version, after.status, after.ended_by) == (lapsing_held.version + 1, "free", "LOCK_EXPIRED")
    assert after.fencing_token == lapsing_held.fencing_token
    # An expired lease is never resurrected: the next acquire gets a higher token.
    [committed] = await ports.locks.commit([_plan(after, Acquire(lapsing, "bot2", 30_000), now)])
    assert committed is not None
    assert (await _load(ports.locks, lapsing))[0].fencing_token > lapsing_held.fencing_token
    assert (await _load(ports.locks, live))[0] == live_held


async def test_the_reaper_never_expires_a_lease_renewed_first(ports: Ports) -> None:
    resource = _resource()
    held = await _hold(ports, resource, 200)
    _, now = await _load(ports.locks, resource)
    renew = _plan(held, Renew(resource, "bot1", held.fencing_token, 30_000), now)
    assert (await ports.locks.commit([renew]))[0] is not None
    await ports.pass_time(0.4)
    assert resource not in await _expire_all(ports.reaper)
    assert (await _load(ports.locks, resource))[0].status == "held"


async def test_the_reaper_purges_keys_older_than_the_retention_only(ports: Ports) -> None:
    resource, key = _resource(), uuid.uuid4().hex
    state, now = await _load(ports.locks, resource)
    await ports.locks.commit([_plan(state, Acquire(resource, "bot1", 30_000), now, key)])
    await ports.pass_time(0.01)
    await ports.reaper.purge_keys(86_400, 10_000)
    [kept] = await ports.locks.load([LoadRequest(resource, "agent", key)])
    assert kept.stored is not None
    while await ports.reaper.purge_keys(0, 1_000) == 1_000:
        pass
    [purged] = await ports.locks.load([LoadRequest(resource, "agent", key)])
    assert purged.stored is None


# --- the saga store ---------------------------------------------------------------------------------


def _saga_id() -> str:
    return f"contract-{uuid.uuid4().hex[:12]}"


def _saga_plan(
    state: SagaState, command: SagaCommand, key: str | None = None, response: dict[str, Any] | None = None
) -> SagaPlan:
    events = decide_saga(state, command)
    idempotency = Idempotency("agent", key, fingerprint("test", stream_id(state.saga_id), {}))
    new_state = fold_saga(state, events)
    return SagaPlan(state.version, events, new_state, {"command": "test"}, idempotency, response or {})


def _start(saga_id: str, lease_ms: int | None = 30_000) -> StartSaga:
    steps = (StepDef("pick", ("zone:A3",)), StepDef("drop", ()))
    return StartSaga(saga_id, "move", "bot1", steps, lease_ms=lease_ms)


async def test_a_saga_never_started_loads_at_version_0(ports: Ports) -> None:
    loaded = await ports.sagas.load(_saga_id(), "agent", "k")
    assert (loaded.row.state.version, loaded.row.state.status, loaded.stored) == (0, None, None)
    assert loaded.row.started_at is None


async def test_a_saga_commit_stamps_its_instants_and_lease_from_the_store_clock(ports: Ports) -> None:
    saga_id = _saga_id()
    loaded = await ports.sagas.load(saga_id, "agent", None)
    ts = await ports.sagas.commit(_saga_plan(loaded.row.state, _start(saga_id)))
    assert ts is not None
    row = (await ports.sagas.load(saga_id, "agent", None)).row
    assert (row.state.version, row.state.status, row.started_at, row.updated_at) == (1, "running", ts, ts)
    assert row.state.lease_expires_at == ts + timedelta(milliseconds=30_000)
    await ports.pass_time(0.01)
    later = await ports.sagas.commit(_saga_plan(row.state, StartStep(saga_id, "pick")))
    assert later is not None
    assert later > ts
    moved = (await ports.sagas.load(saga_id, "agent", None)).row
    assert (moved.state.version, moved.started_at, moved.updated_at) == (2, ts, later)
    assert moved.state.lease_expires_at == later + timedelta(milliseconds=30_000)


async def test_a_saga_plan_on_a_moved_head_writes_nothing(ports: Ports) -> None:
    saga_id = _saga_id()
    fresh = (await ports.sagas.load(saga_id, "agent", None)).row.state
    assert await ports.sagas.commit(_saga_plan(fresh, _start(saga_id))) is not None
    assert await ports.sagas.commit(_saga_plan(fresh, _start(saga_id))) is None  # created meanwhile
    started = (await ports.sagas.load(saga_id, "agent", None)).row.state
    assert await ports.sagas.commit(_saga_plan(started, StartStep(saga_id, "pick"))) is not None
    assert await ports.sagas.commit(_saga_plan(started, AbortSaga(saga_id, "no"))) is None
    now = (await ports.sagas.load(saga_id, "agent", None)).row.state
    assert (now.version, now.status) == (2, "running")


async def test_a_saga_key_keeps_the_answer_and_refuses_a_second_commit(ports: Ports) -> None:
    saga_id, other, key = _saga_id(), _saga_id(), uuid.uuid4().hex
    fresh = (await ports.sagas.load(saga_id, "agent", key)).row.state
    ts = await ports.sagas.commit(_saga_plan(fresh, _start(saga_id), key, {"saga_id": saga_id}))
    assert ts is not None
    loaded = await ports.sagas.load(saga_id, "agent", key)
    assert loaded.stored is not None
    stored = json.loads(loaded.stored.response)  # the view's fields, the commit's instants added
    assert stored["saga_id"] == saga_id
    assert stored["started_at"] == stored["updated_at"] == format_timestamp(ts)
    assert stored["lease_expires_at"] == format_timestamp(ts + timedelta(milliseconds=30_000))
    other_fresh = (await ports.sagas.load(other, "agent", key)).row.state
    with pytest.raises(CommitConflict):
        await ports.sagas.commit(_saga_plan(other_fresh, _start(other), key))
    assert (await ports.sagas.load(other, "agent", None)).row.state.version == 0


async def test_a_lapsed_saga_is_due_and_its_lapse_is_stamped(ports: Ports) -> None:
    lapsing, live, unleased = _saga_id(), _saga_id(), _saga_id()
    for saga_id, lease_ms in ((lapsing, SHORT_MS), (live, 30_000), (unleased, None)):
        fresh = (await ports.sagas.load(saga_id, "agent", None)).row.state
        assert await ports.sagas.commit(_saga_plan(fresh, _start(saga_id, lease_ms))) is not None
    await ports.pass_time(SHORT_MS / 1000 * 2)
    due = {saga.saga_id: saga.now for saga in await ports.reaper.due_sagas(10_000)}
    assert lapsing in due
    assert live not in due
    assert unleased not in due
    row = (await ports.sagas.load(lapsing, "agent", None)).row
    assert row.state.lease_expires_at is not None
    assert row.state.lease_expires_at <= due[lapsing]
    ts = await ports.sagas.commit(_saga_plan(row.state, ExpireSagaLease(lapsing, due[lapsing])))
    lapsed = (await ports.sagas.load(lapsing, "agent", None)).row
    assert lapsed.state.lease_lapsed
    assert lapsed.lease_lapsed_at == ts


def _service(store: LockStore) -> LockService:
    waiters = Waiters(MemoryNotifier(MemoryDatabase()), poll_s=3600)
    return LockService(store, BOUNDS, waiters, DatabaseGuard())


@pytest.mark.parametrize("adapted", [False, True], ids=["bare", "with adapters"])
async def test_the_use_case_runs_on_the_memory_store(adapted: bool) -> None:
    database = MemoryDatabase()
    memory = MemoryLockStore(database)
    store: LockStore = InFlightOrdering(Remembering(memory, 100, database.clock)) if adapted else memory
    service = _service(store)
    ctx = CommandContext(principal="agent", idempotency_key="k1")
    acquired = await service.execute(Acquire("zone:A3", "bot1", 30_000), ctx)
    assert isinstance(acquired.outcome, Granted)
    replayed = await service.execute(Acquire("zone:A3", "bot1", 30_000), ctx)
    assert replayed.replayed
    assert replayed.outcome == acquired.outcome
    with pytest.raises(LockHeld):
        await service.execute(Acquire("zone:A3", "bot2", 30_000), CommandContext())
    token = granted(acquired).fencing_token
    renewed = await service.execute(Renew("zone:A3", "bot1", token), CommandContext())
    assert granted(renewed).expires_at >= granted(acquired).expires_at
    released = await service.execute(Release("zone:A3", "bot1", token), CommandContext())
    assert isinstance(released.outcome, Released)
    assert [event.type for event in database.events["zone:A3"]] == [
        "LOCK_ACQUIRED",
        "LOCK_RENEWED",
        "LOCK_RELEASED",
    ]
    assert service.reads == (2 if adapted else 5)  # with memory: the replay's read and the refusal's
