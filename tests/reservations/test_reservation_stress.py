"""Many agents reserving overlapping routes at once, through HTTP on a real server, with the invariants
checked on what the agents saw and on the log:

- never two holders of a resource (agents mark the zones they hold; the log's stream of each zone never
  grants twice without an end between);
- fencing tokens strictly increasing per resource;
- a reservation is all granted or none (each reservation's grants are one transaction, one per zone);
- no deadlock: every agent finishes all its routes (routes are named in random order, waits are long).
"""

from __future__ import annotations

import asyncio
import itertools
import random

import asyncpg
import httpx
import pytest

pytestmark = pytest.mark.storage

AGENTS = 16
ROUTES = 5
ENDS = {"LOCK_RELEASED", "LOCK_EXPIRED", "LOCK_FORCE_RELEASED"}


async def test_overlapping_routes_reserved_by_many_agents_all_finish_safely(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    zones = [f"{unique_prefix}Z{n}" for n in range(8)]
    holding: dict[str, str] = {}
    violations: list[str] = []
    seen_tokens: dict[str, list[int]] = {zone: [] for zone in zones}

    async def agent(number: int) -> int:
        rng = random.Random(number)
        owner = f"agv-{number}"
        done = 0
        for route_number in range(ROUTES):
            route = rng.sample(zones, rng.randint(2, 4))
            rid = f"{unique_prefix}{owner}-{route_number}"
            while True:  # the server waits at most its LOCKLEDGER_MAX_WAIT_MS (2 s here): ask again
                answer = await http.post(
                    "/v1/reservations",
                    json={"owner": owner, "resources": route, "reservation_id": rid, "wait_ms": 2_000},
                    headers={"Idempotency-Key": rid},
                )
                if answer.status_code == 201:
                    break
                assert answer.status_code == 409, answer.text
                assert answer.json()["code"] == "lock_held"
            leases = answer.json()["leases"]
            for lease in leases:
                if lease["resource"] in holding:
                    violations.append(f"{lease['resource']}: {holding[lease['resource']]} and {rid}")
                holding[lease["resource"]] = rid
                seen_tokens[lease["resource"]].append(lease["fencing_token"])
            await asyncio.sleep(rng.uniform(0, 0.01))
            # Leave the zones one by one, as a vehicle drives through them, or all at once.
            parts = [[lease] for lease in leases] if rng.random() < 0.5 else [leases]
            for part in parts:
                for lease in part:
                    del holding[lease["resource"]]
                released = await http.post(
                    f"/v1/reservations/{rid}/release", json={"owner": owner, "leases": part}
                )
                assert released.status_code == 200, released.text
            done += 1
        return done

    finished = await asyncio.wait_for(asyncio.gather(*(agent(n) for n in range(AGENTS))), 240)

    assert finished == [ROUTES] * AGENTS
    assert violations == []
    for tokens in seen_tokens.values():
        assert sorted(tokens) == tokens
        assert len(set(tokens)) == len(tokens)
    rows = await admin_pool.fetch(
        "SELECT stream_id, stream_version, event_type, (data ->> 'fencing_token')::bigint AS token,"
        " tx_id::text AS tx, metadata ->> 'reservation_id' AS rid"
        " FROM events WHERE stream_id = ANY($1::text[]) ORDER BY stream_id, stream_version",
        zones,
    )
    for zone, events in itertools.groupby(rows, key=lambda row: row["stream_id"]):
        held = False
        last_token = 0
        for event in events:
            if event["event_type"] == "LOCK_ACQUIRED":
                assert not held, f"{zone} granted twice without an end between"
                assert event["token"] > last_token
                last_token = event["token"]
                held = True
            elif event["event_type"] in ENDS:
                held = False
        assert not held
    grants: dict[str, list[asyncpg.Record]] = {}
    for row in rows:
        if row["event_type"] == "LOCK_ACQUIRED":
            grants.setdefault(row["rid"], []).append(row)
    assert len(grants) == AGENTS * ROUTES
    for rid, granted in grants.items():
        assert len({row["tx"] for row in granted}) == 1, f"{rid} granted in several transactions"
        assert len({row["stream_id"] for row in granted}) == len(granted)
