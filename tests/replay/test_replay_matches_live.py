"""Replay agrees with what the fleet saw live: a random concurrent workload on two servers sharing one
database, the live lock list captured many times with the instant each capture is as of, and replay at
every one of those instants giving the same leases.

A command's events are stamped with the clock it read before committing, so a capture taken while a
commit is in flight may show the state just before an event recorded a moment before the capture's
instant (or just after). A difference is tolerated only on a resource with an event that close to the
capture; every other lease must match exactly, and the test counts how many did. Both ways of replaying
are held to it: the log, and holding_periods once the servers' projectors have covered the captures.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from datetime import datetime, timedelta

import asyncpg
import httpx
import pytest

from projections.holding_periods import HOLDING_PERIODS
from projections.replay import COVERED_SQL, LOG, PROJECTION, state_at
from tests.servers import ServerProcess, running_server

pytestmark = pytest.mark.storage

CLOSE = timedelta(seconds=2)  # far longer than a commit takes after its clock read, even on a busy CI
Lease = tuple[str, str, int, str]  # resource, owner, fencing token, deadline


@pytest.fixture(scope="module")
def two_servers(database_url: str) -> Iterator[list[ServerProcess]]:
    overrides = {"LOCKLEDGER_REAPER_INTERVAL_MS": "100"}
    with running_server(database_url, overrides) as first, running_server(database_url, overrides) as second:
        yield [first, second]


async def test_replay_at_each_captured_instant_equals_the_live_list(
    two_servers: list[ServerProcess], admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    rng = random.Random(20261203)
    resources = [f"{unique_prefix}bay:{i}" for i in range(16)]
    clients = [httpx.AsyncClient(base_url=s.base_url, timeout=30.0) for s in two_servers]
    captures: list[tuple[str, set[Lease]]] = []
    stop = asyncio.Event()

    async def agent(name: str) -> None:
        while not stop.is_set():
            resource = rng.choice(resources)
            http = rng.choice(clients)
            ttl_ms = rng.choice([400, 800, 1500])
            answer = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": name, "ttl_ms": ttl_ms})
            if answer.status_code != 201:
                await asyncio.sleep(rng.uniform(0.05, 0.2))
                continue
            token = answer.json()["fencing_token"]
            lease = {"owner": name, "fencing_token": token}
            for _ in range(rng.randint(0, 2)):
                await asyncio.sleep(rng.uniform(0.05, 0.3))
                await rng.choice(clients).post(
                    f"/v1/locks/{resource}/renew", json={**lease, "ttl_ms": ttl_ms}
                )
            await asyncio.sleep(rng.uniform(0.05, 0.3))
            roll = rng.random()
            if roll < 0.55:
                await rng.choice(clients).post(f"/v1/locks/{resource}/release", json=lease)
            elif roll < 0.7:
                await rng.choice(clients).post(f"/v1/locks/{resource}/force-release", json={"reason": "test"})
            else:
                await asyncio.sleep(
                    ttl_ms / 1000
                )  # left to lapse: the reapers record it, or the next acquire

    async def capture() -> None:
        while not stop.is_set():
            answer = await rng.choice(clients).get(
                "/v1/locks", params={"prefix": unique_prefix, "limit": 1000}
            )
            assert answer.status_code == 200, answer.text
            body = answer.json()
            leases = {(i["resource"], i["owner"], i["fencing_token"], i["expires_at"]) for i in body["items"]}
            captures.append((body["at"], leases))
            await asyncio.sleep(rng.uniform(0.02, 0.1))

    tasks = [asyncio.create_task(agent(f"agv-{i}")) for i in range(10)] + [asyncio.create_task(capture())]
    await asyncio.sleep(8)
    stop.set()
    await asyncio.gather(*tasks)

    recorded = await admin_pool.fetch(
        "SELECT stream_id, recorded_at FROM events WHERE starts_with(stream_id, $1)", unique_prefix
    )
    instants = [datetime.fromisoformat(at) for at, _ in captures]
    async with admin_pool.acquire() as conn:
        for _ in range(600):  # the servers' projectors cover the last capture (SETTLE after it)
            covered = await conn.fetchval(COVERED_SQL, HOLDING_PERIODS.name)
            if covered is not None and covered >= max(instants):
                break
            await asyncio.sleep(0.05)
        for source in (LOG, PROJECTION):
            compared = tolerated = 0
            for instant, (_, live_leases) in zip(instants, captures, strict=True):
                found = await state_at(
                    conn, instant, prefix=unique_prefix, limit=1000, use_projection=source == PROJECTION
                )
                assert found.source == source
                replayed = {(x.resource, x.owner, x.fencing_token, x.expires_at) for x in found.locks}
                live = {(r, o, t, datetime.fromisoformat(e)) for r, o, t, e in live_leases}
                near = {r["stream_id"] for r in recorded if abs(r["recorded_at"] - instant) <= CLOSE}
                differing = {lease[0] for lease in live ^ replayed}
                assert differing <= near, (source, instant, sorted(live ^ replayed))
                tolerated += len(differing)
                compared += len({lease[0] for lease in live} - differing)
            # Not vacuous: many captures, most leases compared exactly.
            assert len(captures) >= 40
            assert compared >= 100, (source, compared, tolerated)
            assert tolerated <= compared // 4, (source, compared, tolerated)
    for http in clients:
        await http.aclose()
