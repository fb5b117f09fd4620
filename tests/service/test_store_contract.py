"""One contract, two stores: ``MemoryStore`` and ``PostgresStore`` load and commit alike.

Every test runs against both (the PostgreSQL run is a storage test). Time passes by the store's own
clock: the memory store's is moved by hand, PostgreSQL's by sleeping past a short lease. The use case
(``LockService``) then runs over the memory store with and without the adapters.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import cast

import asyncpg
import pytest

from domain.commands import Acquire, Command, Release, Renew
from domain.decider import decide
from domain.errors import LeaseExpired, LockHeld
from domain.resource import TtlBounds
from domain.state import LockState
from domain.timestamps import format_timestamp
from service.database_guard import DatabaseGuard
from service.idempotency import fingerprint
from service.lock_service import CommandContext, LockService, append_plan
from service.lock_store import AppendPlan, Idempotency
from service.outcomes import Granted, Released
from service.store import CommitConflict, LoadRequest, LockStore, MemoryStore, PostgresStore
from service.store_adapters import InFlightOrdering, Remembering
from service.waiters import Waiters
from tests.conftest import granted

SHORT_MS = 50  # a lease that lapses within the test
BOUNDS = TtlBounds(min_ms=10, max_ms=60_000, default_ms=30_000)


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 5, 5, 9, 30, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


Pass = Callable[[float], Awaitable[None]]


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.storage)])
def store_and_time(request: pytest.FixtureRequest) -> tuple[LockStore, Pass]:
    if request.param == "memory":
        clock = Clock()

        async def advance(seconds: float) -> None:
            clock.now += timedelta(seconds=seconds)

        return MemoryStore(clock), advance
    pool = request.getfixturevalue("service_pool")
    return PostgresStore(pool, acquire_timeout_s=5.0), asyncio.sleep


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
    # Nothing renewed it; a reaper sharing the database may have expired it meanwhile.
    assert after == held or (after.version, after.ended_by) == (held.version + 1, "LOCK_EXPIRED")
    with pytest.raises(LeaseExpired):
        decide(after, Release(resource, "bot1", 1), later, BOUNDS)


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


def _service(store: LockStore) -> LockService:
    waiters = Waiters(cast(asyncpg.Pool, None), poll_s=3600, acquire_timeout_s=1)
    return LockService(store, BOUNDS, waiters, DatabaseGuard())


@pytest.mark.parametrize("adapted", [False, True], ids=["bare", "with adapters"])
async def test_the_use_case_runs_on_the_memory_store(adapted: bool) -> None:
    memory = MemoryStore()
    store: LockStore = InFlightOrdering(Remembering(memory, 100)) if adapted else memory
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
    assert [event.type for event in memory.events["zone:A3"]] == [
        "LOCK_ACQUIRED",
        "LOCK_RENEWED",
        "LOCK_RELEASED",
    ]
    assert service.reads == (2 if adapted else 5)  # with memory: the replay's read and the refusal's
