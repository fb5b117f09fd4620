"""Batched loads and commits (service/coalescer.py, lock_store.commit_many) keep every single-command rule.

A batch must give each plan exactly the outcome the single statement would: its own expected-version and
liveness checks, its own events and idempotency record, and nothing at all when it fails; and a batch that
fails as a whole must write nothing, so the one-by-one retry cannot double anything.
"""

from __future__ import annotations

import asyncio
import json
import random
from datetime import datetime, timedelta

import asyncpg
import pytest

from domain.commands import Acquire, Command, Release, Renew
from domain.decider import decide, fold
from domain.errors import DomainError
from domain.events import event_from_payload
from domain.resource import TtlBounds
from domain.state import LockState
from domain.timestamps import format_timestamp
from eventstore import append
from eventstore.connection import Connection
from eventstore.event_ids import new_event_ids
from eventstore.verify import verify_chains
from service import lock_store
from service.composition import lock_service_on_pool
from service.idempotency import fingerprint
from service.lock_service import CommandContext
from service.ports import AppendPlan, Committed, Idempotency
from tests.assertions import granted

pytestmark = pytest.mark.storage

BOUNDS = TtlBounds(min_ms=1_000, max_ms=600_000, default_ms=30_000)


def _plan(state: LockState, command: Command, now: datetime, key: str | None = None) -> AppendPlan:
    events = decide(state, command, now)
    return AppendPlan(
        expected_version=state.version,
        events=events,
        new_state=fold(state, events),
        require_live=isinstance(command, Renew | Release),
        response={"resource": command.resource},
        metadata={"command": type(command).__name__.lower()},
        idempotency=Idempotency("anonymous", key, fingerprint("x", command.resource, {})),
    )


async def _state(
    conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record], resource: str
) -> tuple[LockState, datetime]:
    snapshot = (await lock_store.load_many(conn, [(resource, "anonymous", None)]))[0]
    return snapshot.state, snapshot.db_now


async def _types(conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record], resource: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT event_type FROM events WHERE stream_id = $1 ORDER BY stream_version", resource
    )
    return [r["event_type"] for r in rows]


async def test_each_plan_of_a_batch_stands_or_falls_on_its_own(
    own_service_pool: asyncpg.Pool, own_admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    new, free, stale, lapsed_renew, lapsed_acquire = (f"{unique_prefix}{n}" for n in range(5))
    async with own_service_pool.acquire() as conn:
        # Prepare: `free` acquired and released; `stale`, `lapsed_*` acquired with short leases.
        for resource, ttl in ((free, 5_000), (stale, 60_000), (lapsed_renew, 1_000), (lapsed_acquire, 1_000)):
            state, now = await _state(conn, resource)
            assert await commit_one(conn, _plan(state, Acquire(resource, "bot1", ttl), now)) is not None
        state, now = await _state(conn, free)
        assert await commit_one(conn, _plan(state, Release(free, "bot1", 1), now)) is not None
        # The renew is decided on the head as it was before its deadline (a reaper, such as the shared
        # test server's, may expire the lease meanwhile: the commit must refuse either way).
        renew_state, _ = await _state(conn, lapsed_renew)
        await asyncio.sleep(1.1)  # the two 1 s leases lapse

        plans = []
        state, now = await _state(conn, new)
        plans.append(_plan(state, Acquire(new, "bot2", 30_000), now, key=f"{unique_prefix}k-new"))
        state, now = await _state(conn, free)
        plans.append(_plan(state, Acquire(free, "bot2", 30_000), now, key=f"{unique_prefix}k-free"))
        state, now = await _state(conn, stale)
        stale_state = LockState(resource=stale)  # decided on an outdated head (version 0, not 1)
        plans.append(_plan(stale_state, Acquire(stale, "bot2", 30_000), now))
        # Decided as if a moment before the deadline; at the append the lease has lapsed.
        assert renew_state.expires_at is not None
        deadline = renew_state.expires_at
        plans.append(_plan(renew_state, Renew(lapsed_renew, "bot1", 1), deadline - timedelta(milliseconds=1)))
        state, now = await _state(conn, lapsed_acquire)
        plans.append(_plan(state, Acquire(lapsed_acquire, "bot2", 30_000), now))

        results = await lock_store.commit_many(conn, plans)

    assert [r is not None for r in results] == [True, True, False, False, True]
    async with own_admin_pool.acquire() as conn:
        assert await _types(conn, new) == ["LOCK_ACQUIRED"]
        assert await _types(conn, free) == ["LOCK_ACQUIRED", "LOCK_RELEASED", "LOCK_ACQUIRED"]
        assert await _types(conn, stale) == ["LOCK_ACQUIRED"]
        assert "LOCK_RENEWED" not in await _types(conn, lapsed_renew)
        assert (await _types(conn, lapsed_acquire))[-2:] == ["LOCK_EXPIRED", "LOCK_ACQUIRED"]
        keys = await conn.fetch(
            "SELECT key, response FROM idempotency_keys WHERE key = ANY($1::text[]) ORDER BY key",
            [f"{unique_prefix}k-free", f"{unique_prefix}k-new"],
        )
        assert len(keys) == 2
        committed = results[1]
        assert committed is not None
        assert committed.expires_at is not None
        assert json.loads(keys[0]["response"])["expires_at"] == format_timestamp(committed.expires_at)
        # The granting event's deadline is the statement's clock + ttl, as in the single statement.
        row = await conn.fetchrow(
            "SELECT data, recorded_at FROM events WHERE stream_id = $1 ORDER BY stream_version DESC LIMIT 1",
            free,
        )
        assert row is not None
        deadline = datetime.fromisoformat(json.loads(row["data"])["expires_at"])
        assert deadline - row["recorded_at"] == timedelta(milliseconds=30_000)


async def test_a_batch_that_fails_writes_nothing(
    own_service_pool: asyncpg.Pool, own_admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    first, second = f"{unique_prefix}a", f"{unique_prefix}b"
    key = f"{unique_prefix}taken"
    async with own_service_pool.acquire() as conn:
        state, now = await _state(conn, f"{unique_prefix}owner-of-key")
        plan = _plan(state, Acquire(f"{unique_prefix}owner-of-key", "bot1", 30_000), now, key=key)
        assert await commit_one(conn, plan) is not None
        plans = []
        for resource, plan_key in ((first, None), (second, key)):  # the second reuses a stored key
            state, now = await _state(conn, resource)
            plans.append(_plan(state, Acquire(resource, "bot1", 30_000), now, key=plan_key))
        with pytest.raises(asyncpg.UniqueViolationError):
            await lock_store.commit_many(conn, plans)
    async with own_admin_pool.acquire() as conn:
        assert await _types(conn, first) == []
        assert await _types(conn, second) == []
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM lock_state WHERE resource = ANY($1::text[])", [first, second]
            )
            == 0
        )


async def test_a_batch_of_one_and_of_none(own_service_pool: asyncpg.Pool, unique_prefix: str) -> None:
    async with own_service_pool.acquire() as conn:
        assert await lock_store.commit_many(conn, []) == []
        resource = f"{unique_prefix}alone"
        state, now = await _state(conn, resource)
        plan = _plan(state, Acquire(resource, "bot1", 30_000), now)
        [committed] = await lock_store.commit_many(conn, [plan])
        assert committed is not None
        assert committed.expires_at is not None
        head, _ = await _state(conn, resource)
        assert (head.owner, head.expires_at) == ("bot1", committed.expires_at)


@pytest.mark.parametrize("processes", [1, 3], ids=["one-service", "three-services"])
async def test_concurrent_workload_through_coalescing_keeps_the_invariants(
    own_service_pool: asyncpg.Pool, own_admin_pool: asyncpg.Pool, unique_prefix: str, processes: int
) -> None:
    """48 agents on 12 resources for 3 s through the coalescing service: one holder at a time per
    resource (no grant while another agent believes it holds), tokens strictly increasing, every
    acknowledged command in the log, and the projection equal to a fold of the events. With three
    services each command goes to one at random, as to three server processes: each decides on what it
    remembers, which the others keep making stale."""
    services = [lock_service_on_pool(own_service_pool, BOUNDS) for _ in range(processes)]
    resources = [f"{unique_prefix}r{i}" for i in range(12)]
    holders: dict[str, str] = {}
    grants: dict[str, list[int]] = {r: [] for r in resources}
    acknowledged: list[tuple[str, int, str]] = []
    violations: list[str] = []
    rng = random.Random(7)
    stop = asyncio.get_running_loop().time() + 3.0

    async def agent(name: str) -> None:
        while asyncio.get_running_loop().time() < stop:
            resource = rng.choice(resources)
            try:
                result = await rng.choice(services).execute(Acquire(resource, name, 30_000), CommandContext())
            except DomainError:
                await asyncio.sleep(0)
                continue
            token = granted(result).fencing_token
            if resource in holders:
                violations.append(f"{name} granted {resource} while {holders[resource]} holds it")
            holders[resource] = name
            grants[resource].append(token)
            acknowledged.append((resource, token, "LOCK_ACQUIRED"))
            if rng.random() < 0.5:
                await rng.choice(services).execute(Renew(resource, name, token, 30_000), CommandContext())
                acknowledged.append((resource, token, "LOCK_RENEWED"))
            del holders[resource]
            await rng.choice(services).execute(Release(resource, name, token), CommandContext())
            acknowledged.append((resource, token, "LOCK_RELEASED"))

    await asyncio.gather(*(agent(f"bot{i}") for i in range(48)))
    assert violations == []
    assert sum(len(g) for g in grants.values()) > 50
    if processes > 1:
        assert all(service.reads > 0 for service in services)  # stale memories were caught and re-read
    for tokens in grants.values():
        assert tokens == sorted(set(tokens))

    async with own_admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT stream_id, stream_version, event_type, data FROM events WHERE stream_id = ANY($1::text[])"
            " ORDER BY stream_id, stream_version",
            resources,
        )
        logged = {(r["stream_id"], json.loads(r["data"])["fencing_token"], r["event_type"]) for r in rows}
        assert set(acknowledged) <= logged
        assert len(acknowledged) == len(rows)  # nothing appended that was not acknowledged
        for resource in resources:
            events = [
                event_from_payload(resource, r["event_type"], json.loads(r["data"]))
                for r in rows
                if r["stream_id"] == resource
            ]
            folded = fold(LockState(resource=resource), events)
            projected = await conn.fetchrow("SELECT * FROM lock_state WHERE resource = $1", resource)
            assert projected is not None
            assert (
                projected["version"],
                projected["status"],
                projected["owner"],
                projected["fencing_token"],
            ) == (folded.version, folded.status, folded.owner, folded.fencing_token)
            assert projected["expires_at"] == folded.expires_at
        report = await verify_chains(conn)
        assert report.ok, report.broken


async def test_both_statements_store_the_event_ids_the_appender_made(
    own_service_pool: asyncpg.Pool, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ids come from ``new_event_ids``, not the column's ``gen_random_uuid()`` (three system calls per
    event in an embedded PostgreSQL built without OpenSSL), and chain like any other."""
    made: list[str] = []

    def recorded(count: int) -> list[str]:
        ids = new_event_ids(count)
        made.extend(ids)
        return ids

    monkeypatch.setattr(append, "new_event_ids", recorded)
    alone, first, second = (f"{unique_prefix}{n}" for n in ("alone", "first", "second"))
    async with own_service_pool.acquire() as conn:
        state, now = await _state(conn, alone)
        assert await commit_one(conn, _plan(state, Acquire(alone, "bot1", 30_000), now)) is not None
        plans = []
        for resource in (first, second):
            state, now = await _state(conn, resource)
            plans.append(_plan(state, Acquire(resource, "bot1", 30_000), now))
        assert None not in await lock_store.commit_many(conn, plans)
        stored = await conn.fetch(
            "SELECT stream_id, replace(event_id::text, '-', '') AS id FROM events"
            " WHERE stream_id = ANY($1::text[]) ORDER BY position",
            [alone, first, second],
        )
        report = await verify_chains(conn)
    assert [row["stream_id"] for row in stored] == [alone, first, second]
    assert [row["id"] for row in stored] == made
    assert report.ok


async def commit_one(conn: Connection, plan: AppendPlan) -> Committed | None:
    """One plan through the commit statement: a batch of one."""
    [committed] = await lock_store.commit_many(conn, [plan])
    return committed
