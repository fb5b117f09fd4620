"""A shared lock's queue spans every server on the database: a writer waiting on one server is served
before readers that arrive after it on another, and each is woken by the other server's release (the
database's NOTIFY, keyed by the lock's stream id)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.assertions import assert_problem
from tests.servers import ServerProcess, running_server

pytestmark = pytest.mark.storage

SETTINGS = {"LOCKLEDGER_REAPER_INTERVAL_MS": "100", "LOCKLEDGER_MAX_WAIT_MS": "20000"}
GUARD_S = 20.0


@pytest.fixture(scope="module")
def two_servers(database_url: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with running_server(database_url, SETTINGS) as first, running_server(database_url, SETTINGS) as second:
        yield first, second


@pytest.fixture
async def clients(
    two_servers: tuple[ServerProcess, ServerProcess],
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    async with (
        httpx.AsyncClient(base_url=two_servers[0].base_url, timeout=30.0) as first,
        httpx.AsyncClient(base_url=two_servers[1].base_url, timeout=30.0) as second,
    ):
        yield first, second


async def _acquire(client: httpx.AsyncClient, resource: str, owner: str, **body: Any) -> httpx.Response:
    return await client.post(
        f"/v1/shared-locks/{resource}/acquire", json={"owner": owner, "ttl_ms": 30_000, **body}
    )


async def _release(client: httpx.AsyncClient, resource: str, answer: httpx.Response) -> None:
    body = {"owner": answer.json()["owner"], "fencing_token": answer.json()["fencing_token"]}
    released = await client.post(f"/v1/shared-locks/{resource}/release", json=body)
    assert released.status_code == 200, released.text


async def _until_queued(client: httpx.AsyncClient, resource: str, owners: list[str]) -> None:
    async with asyncio.timeout(GUARD_S):
        while True:
            state = (await client.get(f"/v1/shared-locks/{resource}")).json()
            if [w["owner"] for w in state["queue"]] == owners:
                return
            await asyncio.sleep(0.02)


async def test_a_writer_waiting_on_one_server_goes_before_readers_on_the_other(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], resource: str
) -> None:
    first, second = clients
    reader = await _acquire(first, resource, "reader-1", mode="shared")
    assert reader.status_code == 201, reader.text
    writer = asyncio.create_task(_acquire(second, resource, "writer", wait_ms=15_000))
    await _until_queued(first, resource, ["writer"])

    late = await _acquire(first, resource, "reader-2", mode="shared")
    assert assert_problem(late, 409, "lock_held")["holder"] == "writer"
    waiting_reader = asyncio.create_task(_acquire(first, resource, "reader-3", mode="shared", wait_ms=15_000))
    await _until_queued(second, resource, ["writer", "reader-3"])

    await _release(first, resource, reader)  # on the first server: the writer waits on the second
    granted = await writer
    assert granted.status_code == 201, granted.text
    await _until_queued(first, resource, ["reader-3"])
    await _release(second, resource, granted)  # on the second: the reader waits on the first
    read = await waiting_reader
    assert read.status_code == 201, read.text
    assert read.json()["fencing_token"] > granted.json()["fencing_token"] > reader.json()["fencing_token"]
    await _release(first, resource, read)
