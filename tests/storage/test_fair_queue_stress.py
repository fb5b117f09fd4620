"""Waiting acquires through HTTP on two real servers sharing one database (docs/decisions/0049): a
queue that spans both, woken across them by the database, with the invariants checked on what the agents
saw and on the log:

- never two holders of a lock (agents mark the locks they hold; no stream grants twice without an end);
- fencing tokens strictly increasing per lock;
- grants to waiters in ticket (arrival) order: each queued grant's event carries its ticket
  (``metadata.queue_ticket``), and along each stream those tickets only grow;
- every waiting acquire either granted (201) or refused when its wait ran out (409 ``lock_held``);
- the queue empty at the end (every waiter that gave up left it; every granted one was removed).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Iterator

import asyncpg
import httpx
import pytest

from tests.servers import ServerProcess, running_server

pytestmark = pytest.mark.storage

AGENTS = 24
ROUNDS = 4
ENDS = {"LOCK_RELEASED", "LOCK_EXPIRED", "LOCK_FORCE_RELEASED"}
SETTINGS = {"LOCKLEDGER_REAPER_INTERVAL_MS": "100", "LOCKLEDGER_MAX_WAIT_MS": "10000"}
GUARD_S = 20.0


@pytest.fixture(scope="module")
def two_servers(database_url: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with running_server(database_url, SETTINGS) as first, running_server(database_url, SETTINGS) as second:
        yield first, second


@pytest.fixture
async def clients(
    two_servers: tuple[ServerProcess, ServerProcess],
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with (
        httpx.AsyncClient(base_url=two_servers[0].base_url, timeout=30.0, limits=limits) as first,
        httpx.AsyncClient(base_url=two_servers[1].base_url, timeout=30.0, limits=limits) as second,
    ):
        yield first, second


async def _queue(client: httpx.AsyncClient, resource: str) -> list[str]:
    answer = await client.get(f"/v1/locks/{resource}")
    assert answer.status_code == 200, answer.text
    return [waiting["owner"] for waiting in answer.json()["queue"]]


async def _until_queue(client: httpx.AsyncClient, resource: str, owners: list[str]) -> None:
    """Wait until the lock's queue, as GET shows it, is ``owners`` (the waiters are other processes)."""
    async with asyncio.timeout(GUARD_S):
        while await _queue(client, resource) != owners:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_the_queue_spans_both_servers_and_shows_in_get(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], resource: str
) -> None:
    a, b = clients
    held = await a.post(f"/v1/locks/{resource}/acquire", json={"owner": "holder"})
    assert held.status_code == 201
    body = {"wait_ms": 10_000}
    first = asyncio.create_task(b.post(f"/v1/locks/{resource}/acquire", json={"owner": "first", **body}))
    await _until_queue(a, resource, ["first"])
    second = asyncio.create_task(a.post(f"/v1/locks/{resource}/acquire", json={"owner": "second", **body}))
    await _until_queue(b, resource, ["first", "second"])

    # Neither server lets an acquire that does not wait jump the queue, once the lock is free.
    token = held.json()["fencing_token"]
    assert (
        await a.post(f"/v1/locks/{resource}/release", json={"owner": "holder", "fencing_token": token})
    ).status_code == 200
    granted = await asyncio.wait_for(first, GUARD_S)  # woken on the other server
    assert granted.status_code == 201, granted.text
    assert granted.json()["owner"] == "first"
    assert await _queue(a, resource) == ["second"]
    refused = await b.post(f"/v1/locks/{resource}/acquire", json={"owner": "newcomer"})
    assert refused.status_code == 409
    assert refused.json()["code"] == "lock_held"

    token = granted.json()["fencing_token"]
    assert (
        await b.post(f"/v1/locks/{resource}/release", json={"owner": "first", "fencing_token": token})
    ).status_code == 200
    granted = await asyncio.wait_for(second, GUARD_S)
    assert granted.status_code == 201, granted.text
    assert granted.json()["owner"] == "second"
    assert await _queue(b, resource) == []


async def test_a_waiter_whose_client_left_passes_its_turn_to_the_next(
    two_servers: tuple[ServerProcess, ServerProcess],
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
    resource: str,
) -> None:
    """First in line on one server, its client gone: the release's NOTIFY wakes it, it sees the closed
    connection, leaves the queue and wakes the next waiter, on the other server, who is granted."""
    a, b = clients
    held = await a.post(f"/v1/locks/{resource}/acquire", json={"owner": "holder"})
    assert held.status_code == 201
    body = {"wait_ms": 10_000}
    async with httpx.AsyncClient(base_url=two_servers[1].base_url, timeout=0.5) as impatient:
        ghost = asyncio.create_task(
            impatient.post(f"/v1/locks/{resource}/acquire", json={"owner": "ghost", **body})
        )
        await _until_queue(a, resource, ["ghost"])
        waiting = asyncio.create_task(a.post(f"/v1/locks/{resource}/acquire", json={"owner": "next", **body}))
        await _until_queue(a, resource, ["ghost", "next"])
        with pytest.raises(httpx.ReadTimeout):
            await ghost
    token = held.json()["fencing_token"]
    released = await a.post(f"/v1/locks/{resource}/release", json={"owner": "holder", "fencing_token": token})
    assert released.status_code == 200
    granted = await asyncio.wait_for(waiting, GUARD_S)
    assert granted.status_code == 201, granted.text
    assert granted.json()["owner"] == "next"
    assert await _queue(b, resource) == []


async def test_many_waiters_on_two_servers_keep_every_invariant(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    locks = [f"{unique_prefix}L{n}" for n in range(3)]
    holding: dict[str, str] = {}
    violations: list[str] = []
    seen_tokens: dict[str, list[int]] = {lock: [] for lock in locks}
    answered: dict[int, int] = {201: 0, 409: 0}
    granted_by = [0, 0]

    async def agent(number: int) -> None:
        rng = random.Random(number)
        owner = f"agv-{number}"
        for _ in range(ROUNDS):
            lock = rng.choice(locks)
            server = rng.randrange(2)
            wait_ms = rng.choice([300, 8_000, 8_000, 8_000])  # some give up, most are served
            answer = await clients[server].post(
                f"/v1/locks/{lock}/acquire", json={"owner": owner, "wait_ms": wait_ms, "ttl_ms": 30_000}
            )
            assert answer.status_code in (201, 409), answer.text
            answered[answer.status_code] += 1
            if answer.status_code == 409:
                assert answer.json()["code"] == "lock_held"
                continue
            granted_by[server] += 1
            lease = answer.json()
            if lock in holding:
                violations.append(f"{lock}: {holding[lock]} and {owner}")
            holding[lock] = owner
            seen_tokens[lock].append(lease["fencing_token"])
            await asyncio.sleep(rng.uniform(0, 0.015))
            del holding[lock]
            released = await clients[rng.randrange(2)].post(
                f"/v1/locks/{lock}/release", json={"owner": owner, "fencing_token": lease["fencing_token"]}
            )
            assert released.status_code == 200, released.text

    await asyncio.wait_for(asyncio.gather(*(agent(n) for n in range(AGENTS))), 240)

    assert violations == []
    assert answered[201] + answered[409] == AGENTS * ROUNDS
    assert granted_by[0] > 0
    assert granted_by[1] > 0
    for tokens in seen_tokens.values():
        assert tokens == sorted(set(tokens))
    rows = await admin_pool.fetch(
        "SELECT stream_id, event_type, (data ->> 'fencing_token')::bigint AS token,"
        " (metadata ->> 'queue_ticket')::bigint AS ticket"
        " FROM events WHERE stream_id = ANY($1::text[]) ORDER BY stream_id, stream_version",
        locks,
    )
    queued_grants = 0
    for lock, events in itertools.groupby(rows, key=lambda row: row["stream_id"]):
        held, last_token, last_ticket = False, 0, 0
        for event in events:
            if event["event_type"] == "LOCK_ACQUIRED":
                assert not held, f"{lock} granted twice without an end between"
                assert event["token"] > last_token
                last_token, held = event["token"], True
                if event["ticket"] is not None:
                    assert event["ticket"] > last_ticket, (
                        f"{lock}: ticket {event['ticket']} after {last_ticket}"
                    )
                    last_ticket = event["ticket"]
                    queued_grants += 1
            elif event["event_type"] in ENDS:
                held = False
        assert not held
    assert queued_grants > 0  # not vacuous: waiters were served through the queue
    left = await admin_pool.fetchval(
        "SELECT count(*) FROM lock_queue WHERE resource = ANY($1::text[])", locks
    )
    assert left == 0
    for lock in locks:
        assert await _queue(clients[0], lock) == []
