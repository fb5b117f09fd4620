"""The SDK's shared locks against a real server, in both twins: ``client.read_lock``, ``client.write_lock``
and ``client.semaphore`` are managed leases (the mutex's ``Lease``, heartbeat and loss rules) on the
shared-lock endpoints."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import lockledger
from lockledger.errors import LockHeld
from tests.servers import ServerProcess

pytestmark = pytest.mark.storage


async def _holders(http: httpx.AsyncClient, resource: str) -> list[tuple[str, str]]:
    state = (await http.get(f"/v1/shared-locks/{resource}")).json()
    return [(h["owner"], h["mode"]) for h in state["holders"]]


async def test_async_readers_hold_together_and_heartbeat(
    server: ServerProcess, http: httpx.AsyncClient, resource: str
) -> None:
    async with (
        lockledger.AsyncClient(server.base_url, agent_id="agv-1") as one,
        lockledger.AsyncClient(server.base_url, agent_id="agv-2") as two,
    ):
        async with one.read_lock(resource, ttl=1.5) as first, two.read_lock(resource, ttl=1.5) as second:
            assert second.fencing_token > first.fencing_token
            assert await _holders(http, resource) == [("agv-1", "shared"), ("agv-2", "shared")]
            deadline = first.expires_at
            for _ in range(100):  # renewed every ttl/3: wait for two renewals, never for a fixed time
                if first.renewals >= 2:
                    break
                await asyncio.sleep(0.1)
            assert first.renewals >= 2
            assert first.expires_at is not None
            assert deadline is not None
            assert first.expires_at > deadline
            with pytest.raises(LockHeld):
                async with one.write_lock(resource, ttl=5):
                    pass  # pragma: no cover - refused on entry
            first.check()
        assert await _holders(http, resource) == []
        async with one.write_lock(resource, ttl=5) as writer:
            assert await _holders(http, resource) == [("agv-1", "exclusive")]
            assert writer.fencing_token > second.fencing_token


async def test_an_async_writer_waits_for_the_readers(
    server: ServerProcess, http: httpx.AsyncClient, resource: str
) -> None:
    async with lockledger.AsyncClient(server.base_url, agent_id="agv-1") as client:
        reading = client.read_lock(resource, ttl=5)
        await reading.__aenter__()

        async def write() -> int:
            async with client.write_lock(resource, owner="forklift-1", ttl=5, wait=10) as lease:
                return lease.fencing_token

        writer = asyncio.create_task(write())
        while True:  # the writer's ticket is taken after its first refusal
            if (await http.get(f"/v1/shared-locks/{resource}")).json()["queue"]:
                break
            await asyncio.sleep(0.01)
        await reading.__aexit__(None, None, None)
        assert await writer > reading.fencing_token


async def test_an_async_semaphore_grants_its_permits(
    server: ServerProcess, http: httpx.AsyncClient, resource: str
) -> None:
    async with lockledger.AsyncClient(server.base_url, agent_id="agv-1") as client:
        async with client.semaphore(resource, 2, ttl=5), client.semaphore(resource, 2, ttl=5, owner="agv-2"):
            state = (await http.get(f"/v1/shared-locks/{resource}")).json()
            assert state["limit"] == 2
            assert len(state["holders"]) == 2
            with pytest.raises(LockHeld):
                async with client.semaphore(resource, 2, owner="agv-3"):
                    pass  # pragma: no cover - refused on entry
        assert await _holders(http, resource) == []


def test_the_blocking_twin_takes_reads_writes_and_permits(server: ServerProcess, resource: str) -> None:
    with lockledger.Client(server.base_url, agent_id="agv-1") as client:
        with client.read_lock(resource, ttl=5) as reading:
            assert client.get_shared_lock(resource)["holders"][0]["fencing_token"] == reading.fencing_token
        with client.write_lock(resource, ttl=5) as writing:
            assert writing.fencing_token > reading.fencing_token
        with client.semaphore(f"{resource}-bay", 4, ttl=5) as permit:
            assert client.get_shared_lock(f"{resource}-bay")["limit"] == 4
            permit.check()
        assert client.get_shared_lock(resource)["holders"] == []
