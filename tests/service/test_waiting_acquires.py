"""Acquires that wait for a held lock (``wait_ms``; service/waiters.py), on the in-memory fakes: woken by
a release through this service or another, by a lapsed lease, in arrival order, never for a caller that
has gone, and never breaking the lock's invariants under a crowd of waiters (that one on PostgreSQL too,
under real transactions). The PostgreSQL notifier is
held to the fake's contract by ``tests/service/test_store_contract.py``; the waits over HTTP, across a
shutdown and through a database outage stay on PostgreSQL (``tests/storage/test_waiting_acquire.py``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from domain.commands import Acquire, Release
from domain.errors import LockHeld
from domain.resource import TtlBounds
from service.clock import SettableClock
from service.composition import lock_service_on_pool
from service.fakes.database import MemoryDatabase
from service.lock_service import CommandContext, LockService
from tests.assertions import granted
from tests.in_memory import lock_service_in_memory

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)
# Far above what any wait below needs, so a missed wake fails the test instead of hanging the suite.
GUARD_S = 20.0
RESOURCE = "zone:A3"


@pytest.fixture
async def service(database: MemoryDatabase) -> AsyncIterator[LockService]:
    """A service of its own (its own memory and waiters), as each server process has. Its follower looks
    only once a minute, so what wakes its waiters within a test is this service's own commits."""
    svc = lock_service_in_memory(database, BOUNDS, wait_poll_s=60)
    yield svc
    await svc.close()


@pytest.fixture
async def following(database: MemoryDatabase) -> AsyncIterator[LockService]:
    """A service whose follower looks every 10 ms, for what only the follower can see."""
    svc = lock_service_in_memory(database, BOUNDS, wait_poll_s=0.01)
    yield svc
    await svc.close()


async def _take(service: LockService, owner: str, ttl_ms: int = 30_000) -> int:
    result = await service.execute(Acquire(RESOURCE, owner, ttl_ms), CommandContext())
    return granted(result).fencing_token


def _events(database: MemoryDatabase) -> list[tuple[str, str, int]]:
    return [(event.type, event.owner, event.fencing_token) for event in database.events.get(RESOURCE, [])]


async def _still_waiting(task: asyncio.Task[object]) -> None:
    """Let the waiting acquire run until it waits (several loop turns), and check it does."""
    for _ in range(20):
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    assert not task.done()  # it waits rather than answering 409


async def test_a_waiting_acquire_is_granted_when_the_holder_releases(service: LockService) -> None:
    held = await _take(service, "holder")
    waiting = asyncio.create_task(
        service.execute(Acquire(RESOURCE, "waiter", 30_000, wait_ms=10_000), CommandContext())
    )
    await _still_waiting(waiting)
    await service.execute(Release(RESOURCE, "holder", held), CommandContext())
    # Released through this same service: woken by the release, where the follower looks once a minute.
    lease = granted(await asyncio.wait_for(waiting, GUARD_S))
    assert lease.owner == "waiter"
    assert lease.fencing_token > held


async def test_a_release_through_another_process_wakes_the_waiter(
    following: LockService, database: MemoryDatabase
) -> None:
    other_process = lock_service_in_memory(database, BOUNDS)
    held = await _take(other_process, "holder")
    waiting = asyncio.create_task(
        following.execute(Acquire(RESOURCE, "waiter", 30_000, wait_ms=10_000), CommandContext())
    )
    await _still_waiting(waiting)
    await other_process.execute(Release(RESOURCE, "holder", held), CommandContext())
    assert granted(await asyncio.wait_for(waiting, GUARD_S)).owner == "waiter"
    await other_process.close()


async def test_a_lapsed_lease_is_taken_over_without_the_reaper(
    following: LockService, database: MemoryDatabase, clock: SettableClock
) -> None:
    held = await _take(following, "crashed", ttl_ms=500)  # its holder never comes back
    waiting = asyncio.create_task(
        following.execute(Acquire(RESOURCE, "waiter", 30_000, wait_ms=10_000), CommandContext())
    )
    await _still_waiting(waiting)
    clock.advance(0.5)  # the deadline itself is already too late
    assert granted(await asyncio.wait_for(waiting, GUARD_S)).owner == "waiter"
    assert _events(database) == [
        ("LOCK_ACQUIRED", "crashed", held),
        ("LOCK_EXPIRED", "crashed", held),  # appended by the waiter's own acquire (no reaper runs here)
        ("LOCK_ACQUIRED", "waiter", held + 2),
    ]


async def test_a_wait_that_runs_out_is_the_usual_refusal(service: LockService) -> None:
    await _take(service, "holder")
    with pytest.raises(LockHeld) as refused:
        await service.execute(Acquire(RESOURCE, "waiter", 30_000, wait_ms=100), CommandContext())
    assert refused.value.holder == "holder"


async def test_the_server_maximum_cuts_a_longer_wait(database: MemoryDatabase) -> None:
    service = lock_service_in_memory(database, BOUNDS, max_wait_ms=100, wait_poll_s=60)
    await _take(service, "holder")
    with pytest.raises(LockHeld):  # cut to 0.1 s: a 60 s wait would outlast the guard
        await asyncio.wait_for(
            service.execute(Acquire(RESOURCE, "waiter", 30_000, wait_ms=60_000), CommandContext()), GUARD_S
        )
    await service.close()


async def test_a_wait_that_runs_out_decides_once_more(service: LockService, clock: SettableClock) -> None:
    """The answer at the deadline is a fresh decision: a lease that lapsed by then is taken over, though
    nothing woke the waiter (this service's follower looks once a minute)."""
    held = await _take(service, "crashed", ttl_ms=600)
    waiting = asyncio.create_task(
        service.execute(Acquire(RESOURCE, "waiter", 30_000, wait_ms=300), CommandContext())
    )
    await _still_waiting(waiting)
    clock.advance(1)
    lease = granted(await asyncio.wait_for(waiting, GUARD_S))
    assert lease.owner == "waiter"
    assert lease.fencing_token == held + 2  # after the LOCK_EXPIRED its own acquire appended


async def test_waiters_in_one_process_are_served_in_arrival_order(
    service: LockService, database: MemoryDatabase
) -> None:
    held = await _take(service, "holder")
    served: list[str] = []

    async def wait_then_hold(owner: str) -> None:
        result = await service.execute(Acquire(RESOURCE, owner, 30_000, wait_ms=15_000), CommandContext())
        served.append(owner)
        token = granted(result).fencing_token
        await asyncio.sleep(0.02)
        await service.execute(Release(RESOURCE, owner, token), CommandContext())

    waiters = []
    for index in range(6):
        waiters.append(asyncio.create_task(wait_then_hold(f"w{index}")))
        await _still_waiting(waiters[-1])  # a definite arrival order
    await service.execute(Release(RESOURCE, "holder", held), CommandContext())
    await asyncio.wait_for(asyncio.gather(*waiters), GUARD_S)
    assert served == [f"w{index}" for index in range(6)]
    # A release wakes only the next in line (each waiter reads about twice: on arrival and on its turn);
    # waking them all to race would cost one read per waiter per release (26 here).
    assert service.reads < 3 * 6
    acquired = [(owner, token) for kind, owner, token in _events(database) if kind == "LOCK_ACQUIRED"]
    assert [owner for owner, _ in acquired] == ["holder", *served]
    tokens = [token for _, token in acquired]
    assert tokens == sorted(set(tokens))  # strictly increasing


async def test_no_lock_is_taken_for_a_caller_that_has_gone(
    service: LockService, database: MemoryDatabase
) -> None:
    held = await _take(service, "holder")
    gone = asyncio.Event()

    async def disconnected() -> bool:
        return gone.is_set()

    waiting = asyncio.create_task(
        service.execute(
            Acquire(RESOURCE, "ghost", 30_000, wait_ms=10_000), CommandContext(), abandoned=disconnected
        )
    )
    await _still_waiting(waiting)
    gone.set()
    await service.execute(Release(RESOURCE, "holder", held), CommandContext())
    with pytest.raises(LockHeld):
        await asyncio.wait_for(waiting, GUARD_S)
    assert [kind for kind, _, _ in _events(database)] == ["LOCK_ACQUIRED", "LOCK_RELEASED"]  # ghost took none


async def test_retries_of_one_waiting_acquire_take_one_lease(service: LockService) -> None:
    """A client that timed out waiting retries under the same Idempotency-Key while its first request
    still waits: one lease, and the retry replays it."""
    held = await _take(service, "holder")
    context = CommandContext(principal="waiter", idempotency_key=str(uuid.uuid4()))
    command = Acquire(RESOURCE, "waiter", 30_000, wait_ms=10_000)
    first = asyncio.create_task(service.execute(command, context))
    await _still_waiting(first)
    retry = asyncio.create_task(service.execute(command, context))
    await _still_waiting(retry)
    await service.execute(Release(RESOURCE, "holder", held), CommandContext())
    results = await asyncio.wait_for(asyncio.gather(first, retry), GUARD_S)
    assert results[0].outcome == results[1].outcome
    assert sorted(r.replayed for r in results) == [False, True]


AGENTS = 24
RESOURCES = 3
CYCLES_PER_AGENT = 6


@dataclass(frozen=True)
class Crowd:
    """Where a crowd of waiters runs: services over one store, and that store's log of a resource as
    (event type, fencing token) pairs."""

    new_service: Callable[[], LockService]
    log: Callable[[str], Awaitable[list[tuple[str, int]]]]
    prefix: str


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.storage)])
def crowd(request: pytest.FixtureRequest, database: MemoryDatabase) -> Crowd:
    """The fakes, or PostgreSQL under real transactions (services whose followers poll every 20 ms)."""
    if request.param == "memory":

        async def memory_log(resource: str) -> list[tuple[str, int]]:
            return [
                (e.type, e.fencing_token) for e in database.events[resource] if hasattr(e, "fencing_token")
            ]

        return Crowd(lambda: lock_service_in_memory(database, BOUNDS, wait_poll_s=0.005), memory_log, "")
    pool = request.getfixturevalue("service_pool")

    async def postgres_log(resource: str) -> list[tuple[str, int]]:
        rows = await pool.fetch(
            "SELECT event_type, (data->>'fencing_token')::bigint AS token"
            " FROM events WHERE stream_id = $1 ORDER BY stream_version",
            resource,
        )
        return [(r["event_type"], r["token"]) for r in rows]

    return Crowd(
        lambda: lock_service_on_pool(pool, BOUNDS, wait_poll_s=0.02),
        postgres_log,
        f"t{uuid.uuid4().hex[:12]}:",
    )


async def test_a_crowd_of_waiters_keeps_one_holder_and_increasing_tokens(crowd: Crowd) -> None:
    """Two services (two processes' worth of waiters) and 24 agents on three locks, every acquire
    waiting: no agent is ever refused, at most one holds each lock at any instant (checked as they hold
    it, and again in the log), and every grant's token is above the one before."""
    services = [crowd.new_service() for _ in range(2)]
    resources = [f"{crowd.prefix}hot{i}" for i in range(RESOURCES)]
    holders: dict[str, str | None] = dict.fromkeys(resources)
    overlaps: list[str] = []
    grants: dict[str, list[int]] = {r: [] for r in resources}

    async def agent(index: int) -> None:
        service = services[index % 2]
        owner = f"agent{index}"
        for cycle in range(CYCLES_PER_AGENT):
            resource = resources[(index + cycle) % RESOURCES]
            result = await service.execute(Acquire(resource, owner, 30_000, wait_ms=30_000), CommandContext())
            token = granted(result).fencing_token
            if holders[resource] is not None:
                overlaps.append(f"{owner} and {holders[resource]} on {resource}")
            holders[resource] = owner
            grants[resource].append(token)
            await asyncio.sleep(0.001)
            holders[resource] = None
            await service.execute(Release(resource, owner, token), CommandContext())

    try:
        await asyncio.wait_for(asyncio.gather(*(agent(i) for i in range(AGENTS))), 120)
    finally:
        for service in services:
            await service.close()
    assert overlaps == []
    assert sum(len(tokens) for tokens in grants.values()) == AGENTS * CYCLES_PER_AGENT
    for resource in resources:
        assert grants[resource] == sorted(set(grants[resource]))
        events = await crowd.log(resource)
        # Every grant is followed by its own release before the next grant: one holder at a time.
        assert [kind for kind, _ in events] == ["LOCK_ACQUIRED", "LOCK_RELEASED"] * len(grants[resource])
        assert [token for kind, token in events if kind == "LOCK_ACQUIRED"] == grants[resource]
