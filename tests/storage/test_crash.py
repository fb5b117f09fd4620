"""No acknowledged event is lost when the server dies mid-load (DESIGN.md, "Errors": "No input ... loses an
acknowledged event").

A dedicated ``lockledger serve`` takes acquire/renew/release cycles from 32 concurrent clients, each request
with an Idempotency-Key, and is SIGKILLed while they are in full swing. Every 2xx a client received must be
in the log afterwards, exactly as acknowledged; the hash chains must be intact; the restarted server must
serve again, and a retry of a request whose response was lost must replay its outcome, never apply it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import httpx
import pytest

from eventstore.verify import verify_chains
from tests.servers import ServerProcess, free_port

pytestmark = [pytest.mark.storage, pytest.mark.slow]

CLIENTS = 32
RESOURCES = 24
LOAD_S = 3.0


@dataclass(frozen=True)
class Ack:
    """A 2xx response: what the server promised is now in the log."""

    command: str
    resource: str
    owner: str
    fencing_token: int
    expires_at: datetime | None
    key: str


@dataclass(frozen=True)
class Lost:
    """A request that got no response (the server died): it may or may not have been applied."""

    command: str
    resource: str
    body: dict[str, Any]
    key: str


@contextlib.contextmanager
def _dedicated_server(database_url: str) -> Iterator[ServerProcess]:
    server = ServerProcess(database_url, free_port(), {})
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _client_loop(
    http: httpx.AsyncClient,
    worker: int,
    resources: list[str],
    acks: list[Ack],
    lost: list[Lost],
    stop_at: float,
) -> None:
    rng = random.Random(worker)
    owner = f"worker{worker}"
    sequence = 0

    async def send(command: str, resource: str, body: dict[str, Any]) -> httpx.Response | None:
        nonlocal sequence
        sequence += 1
        key = f"{owner}-{sequence}"
        try:
            response = await http.post(
                f"/v1/locks/{resource}/{command}", json=body, headers={"Idempotency-Key": key}
            )
        except httpx.TransportError:
            lost.append(Lost(command, resource, body, key))
            return None
        if response.is_success:
            lease = response.json()
            expires_at = lease.get("expires_at")
            acks.append(
                Ack(
                    command,
                    resource,
                    lease["owner"],
                    lease["fencing_token"],
                    datetime.fromisoformat(expires_at) if expires_at is not None else None,
                    key,
                )
            )
        return response

    while time.monotonic() < stop_at:
        resource = rng.choice(resources)
        acquired = await send("acquire", resource, {"owner": owner, "ttl_ms": rng.choice([1000, 2000, 5000])})
        if acquired is None:
            return  # the server is gone
        if acquired.status_code != 201:
            assert acquired.status_code in (409, 503), acquired.text
            await asyncio.sleep(0.005)
            continue
        token = acquired.json()["fencing_token"]
        for _ in range(rng.randint(0, 3)):
            renewed = await send("renew", resource, {"owner": owner, "fencing_token": token})
            if renewed is None:
                return
            # 410 once the lease lapsed; 409 not_holder once someone else has since taken the lock.
            assert renewed.status_code in (200, 409, 410, 503), renewed.text
        released = await send("release", resource, {"owner": owner, "fencing_token": token})
        if released is None:
            return
        assert released.status_code in (200, 409, 410, 503), released.text


async def test_every_acknowledged_command_survives_sigkill(
    database_url: str, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    resources = [f"{unique_prefix}crate{i:02d}" for i in range(RESOURCES)]
    acks: list[Ack] = []
    lost: list[Lost] = []
    with _dedicated_server(database_url) as server:
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10.0, limits=limits) as http:
            stop_at = time.monotonic() + 60.0  # the kill ends the load; this only bounds a broken run
            workers = [
                asyncio.create_task(_client_loop(http, w, resources, acks, lost, stop_at))
                for w in range(CLIENTS)
            ]
            await asyncio.sleep(LOAD_S)
            acked_before_kill = len(acks)
            server.kill()
            async with asyncio.timeout(30):
                await asyncio.gather(*workers)
        assert acked_before_kill > 100, "the load never got going"
        assert len(lost) > 0, "the kill did not interrupt any request"
        server.start()

        async with admin_pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT stream_id, stream_version, event_type, data::text AS data,"
                " metadata ->> 'idempotency_key' AS key FROM events"
                " WHERE starts_with(stream_id, $1) ORDER BY stream_id, stream_version",
                unique_prefix,
            )
            report = await verify_chains(conn)
        assert report.ok, report.broken

        by_version = {(r["stream_id"], r["stream_version"]): r for r in rows}
        by_key: dict[str | None, list[asyncpg.Record]] = {}
        for row in rows:
            by_key.setdefault(row["key"], []).append(row)
        counts = {"acquire": 0, "renew": 0, "release": 0}
        for ack in acks:
            counts[ack.command] += 1
            if ack.command == "acquire":
                event = by_version.get((ack.resource, ack.fencing_token))
                assert event is not None, f"acknowledged acquire lost: {ack}"
                assert event["event_type"] == "LOCK_ACQUIRED"
                assert event["key"] == ack.key
            else:
                matching = [r for r in by_key.get(ack.key, []) if r["stream_id"] == ack.resource]
                assert len(matching) == 1, f"acknowledged {ack.command} lost or doubled: {ack}"
                event = matching[0]
                kind = "LOCK_RENEWED" if ack.command == "renew" else "LOCK_RELEASED"
                assert event["event_type"] == kind
            data = json.loads(event["data"])
            assert data["owner"] == ack.owner
            assert data["fencing_token"] == ack.fencing_token
            if ack.expires_at is not None:
                assert datetime.fromisoformat(data["expires_at"]) == ack.expires_at, ack
        # An Idempotency-Key never applied twice: one command's events share one key (an acquire that found
        # a lapsed lease appends LOCK_EXPIRED and LOCK_ACQUIRED together).
        for key, events in by_key.items():
            if key is not None:
                assert len(events) == 1 or [e["event_type"] for e in events] == [
                    "LOCK_EXPIRED",
                    "LOCK_ACQUIRED",
                ], key

        async with httpx.AsyncClient(base_url=server.base_url, timeout=10.0) as http:
            # Requests cut off by the kill: retried with their key, each is replayed if it was applied
            # (and then exactly as logged) or decided now; never applied a second time.
            replayed = 0
            for request in lost:
                again = await http.post(
                    f"/v1/locks/{request.resource}/{request.command}",
                    json=request.body,
                    headers={"Idempotency-Key": request.key},
                )
                applied = any(r["stream_id"] == request.resource for r in by_key.get(request.key, []))
                assert (again.headers.get("Idempotent-Replayed") == "true") == applied, request
                replayed += applied
            async with admin_pool.acquire() as conn:
                for request in lost:
                    if any(r["stream_id"] == request.resource for r in by_key.get(request.key, [])):
                        logged = await conn.fetchval(
                            "SELECT count(*) FROM events WHERE stream_id = $1"
                            " AND metadata ->> 'idempotency_key' = $2",
                            request.resource,
                            request.key,
                        )
                        assert logged == len(by_key[request.key])

            # The restarted server serves.
            fresh = await http.post(
                f"/v1/locks/{unique_prefix}after-restart/acquire", json={"owner": "bot", "ttl_ms": 5000}
            )
            assert fresh.status_code == 201
            assert fresh.json()["fencing_token"] == 1
    print(
        f"\nSIGKILL after {LOAD_S:.0f} s of load: {len(acks)} 2xx checked in the log ({counts}),"
        f" {len(lost)} requests cut off, {replayed} of them had committed and replayed on retry;"
        f" chains verified over {report.events} events"
    )
