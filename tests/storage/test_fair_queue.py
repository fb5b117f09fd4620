"""The fair queue of waiting acquires (docs/decisions/0049-fair-queues.md) on a real PostgreSQL: two
services (each with its own waiters and listener, as two server processes have) serve their waiters in
arrival order, woken by NOTIFY (their followers look once a minute, so no poll wakes anyone here); an
acquire that does not wait never jumps the queue, not even one decided on a remembered state; a waiter
that gives up leaves it; a dead server's ticket stops counting at its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from domain.commands import Acquire, Release
from domain.decider import decide
from domain.errors import LockHeld
from domain.queue import QueueAhead
from domain.resource import TtlBounds
from service import lock_store
from service.composition import lock_service_on_pool
from service.lock_service import CommandContext, LockService, append_plan
from service.ports import Idempotency
from service.queue_store import PostgresQueue, queue_of
from service.reaper_store import PostgresReaperStore
from tests.assertions import granted

pytestmark = pytest.mark.storage

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)
GUARD_S = 20.0  # far above any wait below: a missed wake fails the test instead of hanging it


@pytest.fixture
async def services(service_pool: asyncpg.Pool) -> AsyncIterator[tuple[LockService, LockService]]:
    first = lock_service_on_pool(service_pool, BOUNDS, wait_poll_s=60)
    second = lock_service_on_pool(service_pool, BOUNDS, wait_poll_s=60)
    yield first, second
    await first.close()
    await second.close()


async def _tickets(pool: asyncpg.Pool, resource: str) -> list[str]:
    async with pool.acquire() as conn:
        return [w.owner for w in await queue_of(conn, resource)]


async def _until_queued(pool: asyncpg.Pool, resource: str, count: int, *, lapsed_too: bool = False) -> None:
    """Wait until ``count`` tickets of ``resource`` are in the table (live ones, or also ``lapsed_too``):
    the database is another process, so there is no event to wait on."""
    sql = "SELECT count(*) FROM lock_queue WHERE resource = $1"
    if not lapsed_too:
        sql += " AND deadline > clock_timestamp()"
    async with asyncio.timeout(GUARD_S), pool.acquire() as conn:
        while await conn.fetchval(sql, resource) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_waiters_on_two_services_are_granted_in_arrival_order(
    services: tuple[LockService, LockService], admin_pool: asyncpg.Pool, resource: str
) -> None:
    ctx = CommandContext()
    token = granted(await services[0].execute(Acquire(resource, "holder", 30_000), ctx)).fencing_token
    waiters: dict[str, asyncio.Task[int]] = {}

    async def wait(service: LockService, owner: str) -> int:
        result = await service.execute(Acquire(resource, owner, 30_000, wait_ms=20_000), ctx)
        return granted(result).fencing_token

    names = [f"w{n}" for n in range(6)]
    for number, name in enumerate(names):
        waiters[name] = asyncio.create_task(wait(services[number % 2], name))
        await _until_queued(admin_pool, resource, number + 1)
    assert await _tickets(admin_pool, resource) == names

    # A new acquire, waiting or not, on either service, is behind them all.
    with pytest.raises(LockHeld):
        await services[1].execute(Acquire(resource, "newcomer", 30_000), ctx)

    owner, order = "holder", []
    for _ in names:
        await services[0].execute(Release(resource, owner, token), ctx)
        done, _pending = await asyncio.wait(
            waiters.values(), timeout=GUARD_S, return_when=asyncio.FIRST_COMPLETED
        )
        assert len(done) == 1, done
        [task] = done
        owner = next(name for name, t in waiters.items() if t is task)
        new_token = task.result()
        assert new_token > token
        token = new_token
        order.append(owner)
        del waiters[owner]
    assert order == names
    assert await _tickets(admin_pool, resource) == []


async def test_an_acquire_that_does_not_wait_does_not_jump_the_queue(
    services: tuple[LockService, LockService], service_pool: asyncpg.Pool, resource: str
) -> None:
    service = services[0]
    ctx = CommandContext()
    token = granted(await service.execute(Acquire(resource, "holder", 30_000), ctx)).fencing_token
    # A waiter of another server, which holds its ticket and is not listening here.
    queue = PostgresQueue(service_pool, 5.0, "elsewhere")
    ticket = await queue.enter(resource, "first", 60_000)
    assert ticket is not None
    await service.execute(Release(resource, "holder", token), ctx)

    with pytest.raises(QueueAhead) as refused:
        await service.execute(Acquire(resource, "newcomer", 30_000), ctx)
    assert refused.value.code == "lock_held"
    assert refused.value.holder == "first"
    # Again, now that this service has read the queue (the first may have been decided on the state
    # remembered since the release); the commit's own check is tested below.
    with pytest.raises(QueueAhead):
        await service.execute(Acquire(resource, "newcomer", 30_000), ctx)
    assert await _tickets(service_pool, resource) == ["first"]

    await queue.leave(ticket)
    assert await _tickets(service_pool, resource) == []
    granted(await service.execute(Acquire(resource, "newcomer", 30_000), ctx))


async def test_the_commit_refuses_a_grant_the_load_saw_no_queue_for(
    service_pool: asyncpg.Pool, services: tuple[LockService, LockService], resource: str
) -> None:
    """The ticket is taken between the load and the commit: the commit's own probe (a fresh snapshot
    after the head is locked) sees it. A release while it waits says so (``queued``)."""
    service = services[0]
    ctx = CommandContext()
    token = granted(await service.execute(Acquire(resource, "holder", 30_000), ctx)).fencing_token
    await service.execute(Release(resource, "holder", token), ctx)
    async with service_pool.acquire() as conn:
        [snapshot] = await lock_store.load_many(conn, [(resource, "p", None)])
    assert snapshot.queue_head is None
    assert snapshot.state.status == "free"
    ticket = await PostgresQueue(service_pool, 5.0, "elsewhere").enter(resource, "first", 60_000)
    assert ticket is not None
    command = Acquire(resource, "newcomer", 30_000)
    events = decide(snapshot.state, command, snapshot.db_now, BOUNDS)
    plan = append_plan(command, snapshot.state, events, {}, Idempotency("p", None, b"\0"))
    assert plan is not None
    async with service_pool.acquire() as conn:
        assert await lock_store.commit_many(conn, [plan]) == [None]
        first_plan = append_plan(
            Acquire(resource, "first", 30_000), snapshot.state, events, {}, Idempotency("p", None, b"\0"),
            ticket=ticket,
        )  # fmt: skip
        assert first_plan is not None
        [committed] = await lock_store.commit_many(conn, [first_plan])
        assert committed is not None
        assert await conn.fetchval("SELECT count(*) FROM lock_queue WHERE ticket = $1", ticket) == 0


async def test_a_release_while_others_queue_is_told_to_wake_them(
    services: tuple[LockService, LockService], service_pool: asyncpg.Pool, resource: str
) -> None:
    service = services[0]
    ctx = CommandContext()
    token = granted(await service.execute(Acquire(resource, "holder", 30_000), ctx)).fencing_token
    await PostgresQueue(service_pool, 5.0, "elsewhere").enter(resource, "first", 60_000)
    async with service_pool.acquire() as conn:
        [snapshot] = await lock_store.load_many(conn, [(resource, "p", None)])
        assert snapshot.queue_head is not None
        assert snapshot.queue_head.owner == "first"
        command = Release(resource, "holder", token)
        events = decide(snapshot.state, command, snapshot.db_now, BOUNDS)
        plan = append_plan(command, snapshot.state, events, {}, Idempotency("p", None, b"\0"))
        assert plan is not None
        [committed] = await lock_store.commit_many(conn, [plan])
    assert committed is not None
    assert committed.queued


async def test_a_waiter_that_gives_up_leaves_the_queue(
    services: tuple[LockService, LockService], service_pool: asyncpg.Pool, resource: str
) -> None:
    ctx = CommandContext()
    granted(await services[0].execute(Acquire(resource, "holder", 30_000), ctx))
    with pytest.raises(LockHeld):
        await services[1].execute(Acquire(resource, "impatient", 30_000, wait_ms=200), ctx)
    async with service_pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM lock_queue WHERE resource = $1", resource) == 0


async def test_a_dead_servers_ticket_stops_counting_at_its_deadline(
    services: tuple[LockService, LockService], service_pool: asyncpg.Pool, resource: str
) -> None:
    """Its waiter never leaves and nothing is notified when it lapses: the next waiter tries again at
    that deadline (the refusal's due time) and is granted."""
    service = services[0]
    ctx = CommandContext()
    token = granted(await service.execute(Acquire(resource, "holder", 30_000), ctx)).fencing_token
    await PostgresQueue(service_pool, 5.0, "dead").enter(resource, "ghost", 1_000)
    waiting = asyncio.create_task(service.execute(Acquire(resource, "next", 30_000, wait_ms=15_000), ctx))
    await _until_queued(service_pool, resource, 2, lapsed_too=True)
    await service.execute(Release(resource, "holder", token), ctx)
    lease = granted(await asyncio.wait_for(waiting, GUARD_S))
    assert lease.owner == "next"
    assert lease.fencing_token > token


async def test_the_reaper_store_purges_only_lapsed_tickets(service_pool: asyncpg.Pool, resource: str) -> None:
    service = lock_service_on_pool(service_pool, BOUNDS, wait_poll_s=60)
    try:
        granted(await service.execute(Acquire(resource, "holder", 30_000), CommandContext()))
    finally:
        await service.close()
    queue = PostgresQueue(service_pool, 5.0, "dead")
    lapsed = await queue.enter(resource, "ghost", 1)
    live = await queue.enter(resource, "waiting", 60_000)
    await asyncio.sleep(0.01)  # the first ticket's deadline, 1 ms after it was taken, has passed
    await PostgresReaperStore(service_pool, 5.0).purge_tickets(1_000)
    async with service_pool.acquire() as conn:
        left = await conn.fetch("SELECT ticket FROM lock_queue WHERE resource = $1", resource)
    assert [row["ticket"] for row in left] == [live]
    assert lapsed is not None
    assert live is not None
    assert lapsed < live
