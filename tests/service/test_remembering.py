"""Commands decided on a remembered state (service/state_cache.py) append in one round trip, and answer
exactly as a command that read first would: a stale memory, a lapsed lease or a retried Idempotency-Key
all end in a read and the usual decision. On the in-memory fakes, several services on one
``MemoryDatabase`` being several server processes with memories of their own; the deadline the
PostgreSQL statement stamps into the log stays on PostgreSQL (tests/storage/test_remembered_state.py).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from domain.commands import Acquire, Command, Release, Renew
from domain.decider import decide
from domain.errors import DomainError, LeaseExpired, LockHeld
from domain.resource import TtlBounds
from service.clock import SettableClock
from service.fakes.database import MemoryDatabase
from service.fakes.lock_store import MemoryLockStore
from service.lock_service import CommandContext, LockService
from service.outcomes import CommandResult, Released
from service.ports import LoadRequest
from service.store_adapters import Remembering
from tests.assertions import granted
from tests.in_memory import lock_service_in_memory

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)


@pytest.fixture
def resource() -> str:
    return f"t{uuid.uuid4().hex[:12]}:zone"


def _service(database: MemoryDatabase) -> LockService:
    """A service with a memory of its own, as each server process has."""
    return lock_service_in_memory(database, BOUNDS)


def _events(database: MemoryDatabase, resource: str) -> list[str]:
    return [event.type for event in database.events.get(resource, [])]


async def test_a_lease_this_process_granted_is_renewed_and_released_without_reading(
    database: MemoryDatabase, resource: str
) -> None:
    service = _service(database)
    acquired = await service.execute(Acquire(resource, "bot1", 30_000), CommandContext())
    token = granted(acquired).fencing_token
    renewed = await service.execute(Renew(resource, "bot1", token, 60_000), CommandContext())
    await service.execute(Release(resource, "bot1", token), CommandContext())
    assert service.reads == 0  # a new stream guessed new, then the remembered lease
    assert _events(database, resource) == ["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"]
    # The release carries the deadline the renewal's commit stamped, not the service's estimate.
    assert database.events[resource][2].expires_at == granted(renewed).expires_at
    again = await service.execute(Acquire(resource, "bot2", 30_000), CommandContext())
    assert granted(again).fencing_token == 4
    assert service.reads == 0


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_stale_memory_costs_a_read_and_never_a_wrong_answer(
    database: MemoryDatabase, resource: str
) -> None:
    before = {
        outcome: _metric("lockledger_commands_from_memory_total", outcome=outcome)
        for outcome in ("appended", "stale")
    }
    reads_before = _metric("lockledger_command_reads_total")
    first, second = _service(database), _service(database)
    await first.execute(Acquire(resource, "bot1", 30_000), CommandContext())
    # `first` remembers bot1's lease; through `second` it ends and bot2 takes the lock.
    await second.execute(Release(resource, "bot1", 1), CommandContext())
    await second.execute(Acquire(resource, "bot2", 30_000), CommandContext())
    # From memory this release is another owner's (403); on a read it is bot2's own.
    released = await first.execute(Release(resource, "bot2", 3), CommandContext())
    assert isinstance(released.outcome, Released)
    assert first.reads == 1
    # From memory the lock is free now; `second` takes it again, so the acquire is read and refused.
    await second.execute(Acquire(resource, "bot3", 30_000), CommandContext())
    with pytest.raises(LockHeld) as held:
        await first.execute(Acquire(resource, "bot4", 30_000), CommandContext())
    assert held.value.holder == "bot3"
    assert first.reads == 2
    # Operators see it on /metrics. From memory: first's guessed-new acquire and second's acquire of the
    # lock it had just released were appended; first's last acquire (lock last seen free) was stale.
    # first's release, refused from memory as another owner's, was simply read: no append was tried.
    assert _metric("lockledger_commands_from_memory_total", outcome="appended") - before["appended"] == 2
    assert _metric("lockledger_commands_from_memory_total", outcome="stale") - before["stale"] == 1
    assert _metric("lockledger_command_reads_total") - reads_before == first.reads + second.reads == 4
    assert _events(database, resource) == [
        "LOCK_ACQUIRED",
        "LOCK_RELEASED",
        "LOCK_ACQUIRED",
        "LOCK_RELEASED",
        "LOCK_ACQUIRED",
    ]


async def test_a_lease_lapsed_by_the_database_clock_is_not_renewed_or_released_from_memory(
    database: MemoryDatabase, clock: SettableClock
) -> None:
    service = _service(database)
    renewed, released = "zone:renew", "zone:release"
    for resource in (renewed, released):
        await service.execute(Acquire(resource, "bot1", 300), CommandContext())
    clock.advance(0.3)  # the deadline itself is too late
    with pytest.raises(LeaseExpired):
        await service.execute(Renew(renewed, "bot1", 1, 30_000), CommandContext())
    with pytest.raises(LeaseExpired):
        await service.execute(Release(released, "bot1", 1), CommandContext())
    for resource in (renewed, released):
        assert _events(database, resource) == ["LOCK_ACQUIRED"]  # the refusals appended nothing


async def test_a_retried_key_replays_its_outcome_instead_of_deciding_from_memory(
    database: MemoryDatabase, resource: str
) -> None:
    service = _service(database)
    acquire = Acquire(resource, "bot1", 30_000)
    first = await service.execute(acquire, CommandContext(idempotency_key="k-acquire"))
    # From memory the lock is held by bot1 now, which would refuse the acquire; the key's outcome wins.
    retried = await service.execute(acquire, CommandContext(idempotency_key="k-acquire"))
    assert (retried.outcome, retried.replayed) == (first.outcome, True)
    release = Release(resource, "bot1", granted(first).fencing_token)
    done = await service.execute(release, CommandContext(idempotency_key="k-release"))
    again = await _service(database).execute(release, CommandContext(idempotency_key="k-release"))
    assert (again.outcome, again.replayed) == (done.outcome, True)
    assert _events(database, resource) == ["LOCK_ACQUIRED", "LOCK_RELEASED"]


def _remembering(service: LockService) -> Remembering:
    """The adapter that remembers states, in the service's store stack."""
    store: object = service.store
    while not isinstance(store, Remembering):
        store = store.inner  # type: ignore[attr-defined]
    return store


async def test_after_a_restart_existing_locks_are_read_and_the_guess_backs_off(
    database: MemoryDatabase, clock: SettableClock
) -> None:
    resources = [f"zone:{i}" for i in range(40)]
    before = _service(database)
    for resource in resources:
        await before.execute(Acquire(resource, "bot1", 30_000), CommandContext())
    restarted = _service(database)  # remembers nothing; every stream exists
    outcomes = []
    for resource in resources:
        with pytest.raises(LockHeld):
            await restarted.execute(Acquire(resource, "bot2", 30_000), CommandContext())
        outcomes.append(restarted.reads)
    assert outcomes[-1] == len(resources)  # each one read, and refused on what it read
    # Guesses failed, so later unknown streams are mostly read first instead of guessed new.
    assert _remembering(restarted).new_streams.rate < 0.5


async def test_concurrent_acquires_of_one_lock_wait_for_the_grant_instead_of_racing_it(
    database: MemoryDatabase, resource: str
) -> None:
    """A hot lock: 20 agents ask for it at once through one process. The first is granted; the others
    wait for that append, then see a held lock (remembered), read it and are refused. None is decided
    on the state before the grant, which the append would refuse as stale (a wasted round trip)."""
    service = _service(database)
    stale_before = _metric("lockledger_commands_from_memory_total", outcome="stale")

    async def agent(i: int) -> str:
        try:
            result = await service.execute(Acquire(resource, f"bot{i}", 30_000), CommandContext())
        except LockHeld as held:
            return f"held by {held.holder}"
        return f"granted {granted(result).fencing_token}"

    outcomes = await asyncio.gather(*(agent(i) for i in range(20)))
    assert outcomes[0] == "granted 1"
    assert outcomes[1:] == ["held by bot0"] * 19
    assert _metric("lockledger_commands_from_memory_total", outcome="stale") == stale_before
    assert service.reads == 19  # each refusal read once (a refusal is never answered from memory)
    assert _events(database, resource) == ["LOCK_ACQUIRED"]


@dataclass(frozen=True)
class Step:
    service: int
    resource: int
    command: str
    owner: int
    right_token: bool
    key: bool


steps = st.builds(
    Step,
    service=st.integers(0, 2),
    resource=st.integers(0, 2),
    command=st.sampled_from(["acquire", "renew", "release", "retry"]),
    owner=st.integers(0, 2),
    right_token=st.booleans(),
    key=st.booleans(),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(steps, min_size=1, max_size=20))
async def test_three_processes_with_their_own_memories_answer_as_a_fresh_read_would(
    story: list[Step],
) -> None:
    """Differential: each step runs on one of three services (each remembers what it did, so the others'
    memories go stale) and must give what ``decide`` gives on the state read just before it: the same
    refusal, or the same events and response; a retried Idempotency-Key replays its stored outcome."""
    database = MemoryDatabase()
    services = [_service(database) for _ in range(3)]
    truths = MemoryLockStore(database)
    prefix = "zone:"
    last: tuple[Command, str, CommandResult] | None = None
    for step in story:
        resource = f"{prefix}{step.resource}"
        [truth] = await truths.load([LoadRequest(resource, "anonymous", None)])
        owner = f"bot{step.owner}"
        token = truth.state.fencing_token if step.right_token else truth.state.fencing_token + 1
        command: Command
        if step.command == "retry" and last is not None:
            command, key, outcome = last
            replayed = await services[step.service].execute(command, CommandContext(idempotency_key=key))
            assert (replayed.outcome, replayed.replayed) == (outcome.outcome, True)
            continue
        if step.command in ("acquire", "retry"):
            command = Acquire(resource, owner, 60_000)
        elif step.command == "renew":
            command = Renew(resource, owner, token, 60_000)
        else:
            command = Release(resource, owner, token)
        key = uuid.uuid4().hex
        try:
            expected = decide(truth.state, command, truth.db_now, BOUNDS)
        except DomainError as refusal:
            with pytest.raises(type(refusal)):
                await services[step.service].execute(command, CommandContext(idempotency_key=key))
            continue
        result = await services[step.service].execute(command, CommandContext(idempotency_key=key))
        assert result.replayed is False
        appended = database.events[resource][truth.state.version :]
        assert [event.type for event in appended] == [event.type for event in expected]
        assert result.outcome.fencing_token == appended[-1].fencing_token
        if step.key:
            last = (command, key, result)
