"""The SDK's reservations against a real server: ``client.reserve([...])`` in both twins takes the set,
heartbeats it as one, releases one lease or the rest, and waits on the server holding nothing."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import pytest

import lockledger
from tests.servers import ServerProcess

pytestmark = pytest.mark.storage


async def _status(http: httpx.AsyncClient, resource: str) -> str:
    return str((await http.get(f"/v1/locks/{resource}")).json()["status"])


async def test_the_async_reservation_heartbeats_the_set_and_releases_one_zone_then_the_rest(
    server: ServerProcess, http: httpx.AsyncClient, unique_prefix: str
) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    async with lockledger.AsyncClient(server.base_url, agent_id="agv-1") as client:
        async with client.reserve([a1, a2], ttl=1.5) as reservation:
            assert set(reservation.tokens) == {a1, a2}
            first_deadline = reservation.expires_at
            for _ in range(100):  # renewed every ttl/3: wait for two renewals, never for a fixed time
                if reservation.renewals >= 2:
                    break
                await asyncio.sleep(0.1)
            assert reservation.renewals >= 2
            assert not reservation.lost.is_set()
            assert reservation.expires_at is not None
            assert first_deadline is not None
            assert reservation.expires_at > first_deadline
            states = [(await http.get(f"/v1/locks/{r}")).json() for r in (a1, a2)]
            assert states[0]["expires_at"] == states[1]["expires_at"]  # one deadline for the set

            await reservation.release(a1)
            assert await _status(http, a1) == "free"
            assert await _status(http, a2) == "held"
            reservation.check()
        assert await _status(http, a2) == "free"
        assert reservation.lost.is_set()  # over: late readers must not trust it


async def test_the_records_name_the_reservation_and_count_the_queue(
    server: ServerProcess, http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    """``get_lock``, ``list_locks`` and ``replay_state`` name the reservation of each reserved lease, and
    a lock's records count the acquires queued for it (``queued``) and list them (``queue``)."""
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    async with lockledger.AsyncClient(server.base_url, agent_id="agv-1") as client:
        reserved = await client.reserve_set([a1, a2], "agv-1", ttl=30, reservation_id="route-9")
        waiting = asyncio.create_task(
            http.post(f"/v1/locks/{a1}/acquire", json={"owner": "agv-2", "ttl_ms": 30_000, "wait_ms": 20_000})
        )
        for _ in range(100):
            info = await client.get_lock(a1)
            if info.queue:
                break
            await asyncio.sleep(0.05)
        assert (info.reservation_id, info.queued, [q.owner for q in info.queue]) == ("route-9", 1, ["agv-2"])
        page = await client.list_locks(prefix=unique_prefix)
        assert [(lock.resource, lock.reservation_id, lock.queued) for lock in page.items] == [
            (a1, "route-9", 1), (a2, "route-9", 0),
        ]  # fmt: skip
        at = await admin_pool.fetchval("SELECT clock_timestamp()")
        await client.release_reservation("route-9", "agv-1", reserved.tokens)
        assert (await waiting).status_code == 201
        state = await client.replay_state(at, prefix=unique_prefix)
        assert [(lease.resource, lease.reservation_id) for lease in state.locks] == [
            (a1, "route-9"), (a2, "route-9"),
        ]  # fmt: skip


async def test_the_async_reservation_waits_for_the_whole_set(
    server: ServerProcess, http: httpx.AsyncClient, unique_prefix: str
) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    held = (await http.post(f"/v1/locks/{a2}/acquire", json={"owner": "agv-7"})).json()
    async with lockledger.AsyncClient(server.base_url, agent_id="agv-1") as client:

        async def route() -> dict[str, int]:
            async with client.reserve([a1, a2], ttl=10, wait=10) as reservation:
                return dict(reservation.tokens)

        waiting = asyncio.create_task(route())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await http.post(
            f"/v1/locks/{a2}/release", json={"owner": "agv-7", "fencing_token": held["fencing_token"]}
        )
        tokens = await asyncio.wait_for(waiting, 20)
    assert tokens == {a1: 1, a2: 3}


async def test_a_refused_reservation_names_every_holder(
    server: ServerProcess, http: httpx.AsyncClient, unique_prefix: str
) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    await http.post(f"/v1/locks/{a2}/acquire", json={"owner": "agv-7"})
    async with lockledger.AsyncClient(server.base_url, agent_id="agv-1") as client:
        with pytest.raises(lockledger.LockHeld) as refused:
            async with client.reserve([a1, a2]):
                pytest.fail("granted a held zone")
    assert refused.value.holder == "agv-7"
    assert refused.value.problem["conflicts"][0]["resource"] == a2


async def test_a_force_released_zone_loses_the_reservation(
    server: ServerProcess, http: httpx.AsyncClient, unique_prefix: str
) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    lost: list[lockledger.LockLost] = []
    client = lockledger.AsyncClient(server.base_url, agent_id="agv-1")
    async with client, client.reserve([a1, a2], ttl=1.5, on_lost=lost.append) as reservation:
        await http.post(f"/v1/locks/{a2}/force-release", json={"reason": "robot pushed aside"})
        await asyncio.wait_for(reservation.lost.wait(), 10)
        with pytest.raises(lockledger.LockLost):
            reservation.check()
    # The exit's release of the set was refused (a2 ended): after a loss, a1 is released alone.
    assert await _status(http, a1) == "free"
    assert [error.resource for error in lost] == [a2]


def test_the_blocking_reservation_takes_and_releases_the_set(
    server: ServerProcess, unique_prefix: str
) -> None:
    a1, a2 = f"{unique_prefix}A1", f"{unique_prefix}A2"
    with lockledger.Client(server.base_url, agent_id="agv-1") as client:
        with client.reserve([a1, a2], ttl=5) as reservation:
            assert set(reservation.tokens) == {a1, a2}
            assert client.get_lock(a1).status == "held"
            reservation.release(a2)
            assert client.get_lock(a2).status == "free"
        assert client.get_lock(a1).status == "free"
