"""Commands decided on a remembered state (service/state_cache.py) append in one round trip, and answer
exactly as a command that read first would: a stale memory, a lapsed lease or a retried Idempotency-Key
all end in a read and the usual decision."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from domain.commands import Acquire, Command, Release, Renew
from domain.decider import decide
from domain.errors import DomainError, LeaseExpired, LockHeld
from domain.resource import TtlBounds
from service import lock_store
from service.lock_service import CommandContext, LockService
from service.outcomes import CommandResult, Released
from service.store_adapters import Remembering
from tests.conftest import granted

pytestmark = pytest.mark.storage

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)


def _service(pool: asyncpg.Pool) -> LockService:
    """A service with a memory of its own, as each server process has."""
    return LockService.on_pool(pool, BOUNDS)


async def _events(pool: asyncpg.Pool, resource: str) -> list[tuple[str, dict[str, object]]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event_type, data FROM events WHERE stream_id = $1 ORDER BY stream_version", resource
        )
    return [(r["event_type"], json.loads(r["data"])) for r in rows]


async def test_a_lease_this_process_granted_is_renewed_and_released_without_reading(
    service_pool: asyncpg.Pool, resource: str
) -> None:
    service = _service(service_pool)
    acquired = await service.execute(Acquire(resource, "bot1", 30_000), CommandContext())
    token = granted(acquired).fencing_token
    await service.execute(Renew(resource, "bot1", token, 60_000), CommandContext())
    await service.execute(Release(resource, "bot1", token), CommandContext())
    assert service.reads == 0  # a new stream guessed new, then the remembered lease
    events = await _events(service_pool, resource)
    assert [t for t, _ in events] == ["LOCK_ACQUIRED", "LOCK_RENEWED", "LOCK_RELEASED"]
    # The release carries the deadline the renewal's statement stamped, not the service's estimate.
    # Compared as instants: PostgreSQL writes the stamped one without trailing zeros (".98699"), Python's
    # isoformat keeps six digits (".986990").
    released_at, renewed_until = (datetime.fromisoformat(str(events[i][1]["expires_at"])) for i in (2, 1))
    assert released_at == renewed_until
    again = await service.execute(Acquire(resource, "bot2", 30_000), CommandContext())
    assert granted(again).fencing_token == 4
    assert service.reads == 0


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_stale_memory_costs_a_read_and_never_a_wrong_answer(
    service_pool: asyncpg.Pool, resource: str
) -> None:
    before = {
        outcome: _metric("lockledger_commands_from_memory_total", outcome=outcome)
        for outcome in ("appended", "stale")
    }
    reads_before = _metric("lockledger_command_reads_total")
    first, second = _service(service_pool), _service(service_pool)
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
    assert [t for t, _ in await _events(service_pool, resource)] == [
        "LOCK_ACQUIRED",
        "LOCK_RELEASED",
        "LOCK_ACQUIRED",
        "LOCK_RELEASED",
        "LOCK_ACQUIRED",
    ]


async def test_a_lease_lapsed_by_the_database_clock_is_not_renewed_or_released_from_memory(
    service_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    service = _service(service_pool)
    renewed, released = f"{unique_prefix}renew", f"{unique_prefix}release"
    for resource in (renewed, released):
        await service.execute(Acquire(resource, "bot1", 300), CommandContext())
    await asyncio.sleep(0.4)
    with pytest.raises(LeaseExpired):
        await service.execute(Renew(renewed, "bot1", 1, 30_000), CommandContext())
    with pytest.raises(LeaseExpired):
        await service.execute(Release(released, "bot1", 1), CommandContext())
    for resource in (renewed, released):
        # Only an expiry may follow (this test's or another server's reaper records it).
        assert [t for t, _ in await _events(service_pool, resource)][1:] in ([], ["LOCK_EXPIRED"])


async def test_a_retried_key_replays_its_outcome_instead_of_deciding_from_memory(
    service_pool: asyncpg.Pool, resource: str
) -> None:
    service = _service(service_pool)
    acquire = Acquire(resource, "bot1", 30_000)
    first = await service.execute(acquire, CommandContext(idempotency_key="k-acquire"))
    # From memory the lock is held by bot1 now, which would refuse the acquire; the key's outcome wins.
    retried = await service.execute(acquire, CommandContext(idempotency_key="k-acquire"))
    assert (retried.outcome, retried.replayed) == (first.outcome, True)
    release = Release(resource, "bot1", granted(first).fencing_token)
    done = await service.execute(release, CommandContext(idempotency_key="k-release"))
    again = await _service(service_pool).execute(release, CommandContext(idempotency_key="k-release"))
    assert (again.outcome, again.replayed) == (done.outcome, True)
    assert [t for t, _ in await _events(service_pool, resource)] == ["LOCK_ACQUIRED", "LOCK_RELEASED"]


def _remembering(service: LockService) -> Remembering:
    """The adapter that remembers states, in the service's store stack."""
    store: object = service.store
    while not isinstance(store, Remembering):
        store = store.inner  # type: ignore[attr-defined]
    return store


async def test_after_a_restart_existing_locks_are_read_and_the_guess_backs_off(
    service_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    resources = [f"{unique_prefix}{i}" for i in range(40)]
    before = _service(service_pool)
    for resource in resources:
        await before.execute(Acquire(resource, "bot1", 30_000), CommandContext())
    restarted = _service(service_pool)  # remembers nothing; every stream exists
    outcomes = []
    for resource in resources:
        with pytest.raises(LockHeld):
            await restarted.execute(Acquire(resource, "bot2", 30_000), CommandContext())
        outcomes.append(restarted.reads)
    assert outcomes[-1] == len(resources)  # each one read, and refused on what it read
    # Guesses failed, so later unknown streams are mostly read first instead of guessed new.
    assert _remembering(restarted).new_streams.rate < 0.5


async def test_concurrent_acquires_of_one_lock_wait_for_the_grant_instead_of_racing_it(
    service_pool: asyncpg.Pool, resource: str
) -> None:
    """A hot lock: 20 agents ask for it at once through one process. The first is granted; the others
    wait for that append, then see a held lock (remembered), read it and are refused. None is decided
    on the state before the grant, which the append would refuse as stale (a wasted round trip)."""
    service = _service(service_pool)
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
    assert [t for t, _ in await _events(service_pool, resource)] == ["LOCK_ACQUIRED"]


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
    service_pool: asyncpg.Pool, story: list[Step]
) -> None:
    """Differential: each step runs on one of three services (each remembers what it did, so the others'
    memories go stale) and must give what ``decide`` gives on the state read just before it: the same
    refusal, or the same events and response; a retried Idempotency-Key replays its stored outcome."""
    services = [_service(service_pool) for _ in range(3)]
    prefix = f"d{uuid.uuid4().hex[:10]}:"
    last: tuple[Command, str, CommandResult] | None = None
    for step in story:
        resource = f"{prefix}{step.resource}"
        async with service_pool.acquire() as conn:
            truth = (await lock_store.load_many(conn, [(resource, "anonymous", None)]))[0]
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
        appended = (await _events(service_pool, resource))[truth.state.version :]
        assert [t for t, _ in appended] == [event.type for event in expected]
        assert result.outcome.fencing_token == appended[-1][1]["fencing_token"]
        if step.key:
            last = (command, key, result)
