"""Many agents take read, write and semaphore grants at once through HTTP (a real server, a real
PostgreSQL), and the exclusion rules hold both in what they saw and in the log.

What they saw: each agent, once granted, records its grant as held until it sends its release; a grant
answered while the agent holds it is truly held then (its TTL is far longer than the test), so two such
records that overlap are two grants held at once. From the log: the shared locks' streams folded event by
event, every grant checked against the grants live at the instant of its append. Either way: never two
exclusive holders, readers never with a writer, never more than the limit, tokens strictly increasing.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from typing import Any

import asyncpg
import httpx
import pytest

from domain.shared_lock import (
    EXCLUSIVE,
    SHARED_ACQUIRED,
    SharedLockState,
    evolve,
    shared_event_from_payload,
    stream_id,
)

pytestmark = pytest.mark.storage

AGENTS = 16
ROUNDS = 8
LIMIT = 3
TTL_MS = 60_000


class Seen:
    """The grants the agents hold now, by resource (token -> mode), and every token they were given."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, str]] = defaultdict(dict)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.granted: dict[str, int] = defaultdict(int)

    def take(self, resource: str, token: int, mode: str, limit: int | None) -> None:
        held = self.held[resource]
        assert token not in held
        if mode == EXCLUSIVE:
            assert not held, f"{resource}: a writer granted while {held} hold"
        else:
            assert EXCLUSIVE not in held.values(), f"{resource}: a reader granted while a writer holds"
            assert limit is None or len(held) < limit, f"{resource}: more than {limit} holders"
        held[token] = mode
        self.tokens[resource].append(token)
        self.granted[resource] += 1

    def drop(self, resource: str, token: int) -> None:
        del self.held[resource][token]


async def _post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST, again after a 503 (the lock too contended to decide: nothing was written, retry), as the
    SDK does."""
    for _ in range(20):
        answer = await http.post(path, json=body)
        if answer.status_code != 503:
            return answer
        await asyncio.sleep(0.05)
    return answer


async def _agent(
    http: httpx.AsyncClient, number: int, rw: str, semaphore: str, seen: Seen, rng: random.Random
) -> None:
    owner = f"agent-{number}"
    for _ in range(ROUNDS):
        kind = rng.choice(["read", "read", "write", "permit"])
        resource = semaphore if kind == "permit" else rw
        body: dict[str, Any] = {
            "owner": owner,
            "mode": "exclusive" if kind == "write" else "shared",
            "ttl_ms": TTL_MS,
            "wait_ms": 2_000,
        }
        if kind == "permit":
            body["limit"] = LIMIT
        answer = await _post(http, f"/v1/shared-locks/{resource}/acquire", body)
        if answer.status_code == 409:  # waited its longest: the others kept it busy
            assert answer.json()["code"] == "lock_held"
            continue
        assert answer.status_code == 201, answer.text
        grant = answer.json()
        seen.take(resource, grant["fencing_token"], grant["mode"], grant["limit"])
        await asyncio.sleep(rng.uniform(0, 0.01))
        seen.drop(resource, grant["fencing_token"])
        released = await _post(
            http,
            f"/v1/shared-locks/{resource}/release",
            {"owner": owner, "fencing_token": grant["fencing_token"]},
        )
        assert released.status_code == 200, released.text


def _check_log(resource: str, rows: list[asyncpg.Record], limit: int | None) -> int:
    """Fold the stream's events; at every grant, the grants live at its append allow it. The number of
    grants."""
    state = SharedLockState(resource)
    last_token = 0
    grants = 0
    for row in rows:
        event = shared_event_from_payload(resource, row["event_type"], json.loads(row["data"]))
        if row["event_type"] == SHARED_ACQUIRED:
            at = row["recorded_at"]
            live = state.live(at)
            assert event.fencing_token == row["stream_version"] > last_token
            last_token = event.fencing_token
            if event.mode == EXCLUSIVE:  # type: ignore[union-attr]
                assert not live, (resource, event, live)
            else:
                assert all(g.mode != EXCLUSIVE for g in live), (resource, event, live)
                assert limit is None or len(live) < limit, (resource, event, live)
            grants += 1
        state = evolve(state, event)
    return grants


async def test_concurrent_grants_never_break_exclusion(
    http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    rw, semaphore = f"{unique_prefix}rw", f"{unique_prefix}bay"
    seen = Seen()
    rng = random.Random(35)
    await asyncio.gather(
        *(_agent(http, n, rw, semaphore, seen, random.Random(rng.random())) for n in range(AGENTS))
    )
    for resource, limit in ((rw, None), (semaphore, LIMIT)):
        assert seen.granted[resource] > AGENTS  # most agents got most of their grants
        assert not seen.held[resource]
        tokens = seen.tokens[resource]
        assert len(set(tokens)) == len(tokens)
        rows = await admin_pool.fetch(
            "SELECT stream_version, event_type, data::text AS data, recorded_at FROM events"
            " WHERE stream_id = $1 ORDER BY stream_version",
            stream_id(resource),
        )
        assert _check_log(resource, list(rows), limit) == seen.granted[resource]
        assert sorted(tokens) == [
            row["stream_version"] for row in rows if row["event_type"] == SHARED_ACQUIRED
        ]
