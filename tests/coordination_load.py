"""Agents using every coordination primitive at once, through HTTP on several servers sharing a database.

Each agent loops over cycles: it answers the hand-offs offered to it (accept, then release, or decline),
then either takes one lock (an acquire that often waits, so it queues: ``wait_ms``), renews it and
releases it or hands it to another agent, or reserves an overlapping route of two or three zones, renews
the set and releases it zone by zone or whole, or takes a shared lock: a read or write lock on one
read/write lock, or a permit of one semaphore, waiting like the single acquires, renewing half the time,
then releasing. Single locks and routes draw from the same few resources, so acquires, queued waiters,
reservations and hand-offs contend for them; readers, writers and permits contend for the two shared
locks.

Every command carries its own Idempotency-Key and is retried under it while its outcome is unknown
(timeout, broken connection, 5xx), each retry on the next server, as a load balancer would send it, so a
server killed mid-load turns into retries the others must not apply twice. Every request goes through a
:class:`~tests.faults.history.History`; :class:`QueueWatcher` keeps every ticket ``lock_queue`` showed,
so the FIFO check knows who waited (tests/invariants.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx

from eventstore.dburl import asyncpg_dsn
from tests.faults.history import History, Operation
from tests.faults.load import post_recorded
from tests.invariants import QueuedTicket, read_queue


@dataclass(frozen=True)
class Mix:
    """The shape of the load: how many agents, how many cycles each (None: until stopped), and the
    shares of each primitive. Waits are long enough to queue behind two or three holders."""

    agents: int = 12
    cycles: int | None = 10
    resources: int = 5
    ttl_ms: int = 3_000
    waits_ms: tuple[int, ...] = (0, 1_000, 2_500, 2_500)
    reserve: float = 0.3  # share of cycles that reserve a route
    shared: float = 0.35  # share of cycles that take a shared lock (the rest take one lock)
    write: float = 0.35  # share of the read/write lock's acquires that are a writer's
    permit: float = 0.4  # share of shared cycles that take a semaphore's permit
    permits: int = 2  # the semaphore's limit
    hand_off: float = 0.35  # share of single leases handed to another agent rather than released
    accept: float = 0.7  # share of offers accepted (the rest declined)
    accept_within_ms: int = 5_000  # more than the longest wait: a busy receiver still answers
    hold_s: float = 0.04  # longest pause while holding
    shared_hold_s: float = 0.6  # longest pause while holding a shared lock (so others queue behind it)
    attempts: int = 6  # requests per command while its outcome stays unknown
    backoff_s: float = 0.15  # first pause before a retry; doubles, capped at 1.2 s
    timeout_s: float = 10.0  # per request: more than the longest wait
    grace_s: float = 8.0  # how long retries may go on after the load was told to stop


@dataclass(frozen=True)
class Offer:
    """A lease handed to an agent: it may accept or decline it."""

    resource: str
    giver: str


class CoordinationLoad:
    """``start()`` the agents, inject faults meanwhile if any, then ``finish()`` (every agent ran its
    cycles) or ``stop()`` (stop starting commands; finish those in hand within the grace period)."""

    def __init__(self, base_urls: list[str], prefix: str, history: History, mix: Mix, seed: int = 0) -> None:
        self.base_urls = base_urls
        self.prefix = prefix
        self.resources = [f"{prefix}z{n}" for n in range(mix.resources)]
        self.history = history
        self.mix = mix
        self.seed = seed
        self.rw_lock = f"shared/{prefix}rw"  # shared commands name their stream (tests/invariants.py)
        self.semaphore = f"shared/{prefix}sem"
        self.requested: dict[str, frozenset[str]] = {}  # reservation id -> its resources, as asked
        self.done: dict[str, int] = defaultdict(int)  # primitive -> acknowledged commands
        self.granted: dict[str, int] = defaultdict(int)  # read, write, permit -> acknowledged grants
        self._mailboxes: dict[str, asyncio.Queue[Offer]] = {}
        self._offers_answered = 0  # by every agent
        self._stopping = asyncio.Event()
        self._retry_until = float("inf")
        self._agents: list[asyncio.Task[None]] = []
        self._clients: list[httpx.AsyncClient] = []

    def owner(self, number: int) -> str:
        return f"agv-{number:02d}"

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=self.mix.agents * 2, max_keepalive_connections=self.mix.agents)
        self._clients = [
            httpx.AsyncClient(base_url=url, timeout=self.mix.timeout_s, limits=limits)
            for url in self.base_urls
        ]
        self._mailboxes = {self.owner(n): asyncio.Queue() for n in range(self.mix.agents)}
        self._agents = [
            asyncio.create_task(self._agent(n), name=f"agent-{n}") for n in range(self.mix.agents)
        ]

    async def finish(self, guard_s: float) -> None:
        """Wait for every agent to run its cycles (at most ``guard_s``), then close."""
        try:
            await asyncio.wait_for(asyncio.gather(*self._agents), guard_s)
        finally:
            await self._close()

    async def stop(self) -> None:
        self._stopping.set()
        self._retry_until = time.monotonic() + self.mix.grace_s
        _, pending = await asyncio.wait(self._agents, timeout=self.mix.grace_s + 2 * self.mix.timeout_s)
        for task in pending:
            task.cancel()
        await self._close()

    async def _close(self) -> None:
        results = await asyncio.gather(*self._agents, return_exceptions=True)
        for client in self._clients:
            await client.aclose()
        for task, result in zip(self._agents, results, strict=True):
            if isinstance(result, Exception):
                raise RuntimeError(f"{task.get_name()} failed") from result

    # --- the agent ----------------------------------------------------------------------------------

    async def _agent(self, number: int) -> None:
        rng = random.Random(self.seed * 1_000 + number)
        owner = self.owner(number)
        cycle = 0
        while not self._stopping.is_set() and (self.mix.cycles is None or cycle < self.mix.cycles):
            cycle += 1
            await self._answer_offers(rng, owner)
            draw = rng.random()
            if draw < self.mix.reserve:
                await self._route(rng, owner, f"{self.prefix}{owner}-{cycle}")
            elif draw < self.mix.reserve + self.mix.shared:
                await self._shared(rng, owner)
            else:
                await self._single(rng, owner, number)
        await self._answer_offers(rng, owner)

    async def _answer_offers(self, rng: random.Random, owner: str) -> None:
        mailbox = self._mailboxes[owner]
        while not mailbox.empty():
            offer = mailbox.get_nowait()
            # The load's first offer is declined and its second accepted, so every run has both answers
            # whatever the draws give; later offers are drawn.
            answered, self._offers_answered = self._offers_answered, self._offers_answered + 1
            accept = rng.random() < self.mix.accept if answered > 1 else answered == 1
            if not accept:
                await self._command(rng, "decline", offer.resource, {"owner": owner})
                continue
            accepted = await self._command(
                rng, "accept", offer.resource, {"owner": owner, "ttl_ms": self.mix.ttl_ms}
            )
            if accepted is not None and accepted.ok and accepted.response is not None:
                await self._hold(rng)
                lease = {"owner": owner, "fencing_token": accepted.response["fencing_token"]}
                await self._command(rng, "release", offer.resource, lease)

    async def _single(self, rng: random.Random, owner: str, number: int) -> None:
        resource = rng.choice(self.resources)
        body = {"owner": owner, "ttl_ms": self.mix.ttl_ms, "wait_ms": rng.choice(self.mix.waits_ms)}
        acquired = await self._command(rng, "acquire", resource, body)
        if acquired is None or not acquired.ok or acquired.response is None:
            return
        lease = {"owner": owner, "fencing_token": acquired.response["fencing_token"]}
        await self._hold(rng)
        if rng.random() < 0.5:
            renewed = await self._command(rng, "renew", resource, lease)
            if renewed is None or not renewed.ok:
                return
            await self._hold(rng)
        if rng.random() < self.mix.hand_off and self.mix.agents > 1:
            others = [n for n in range(self.mix.agents) if n != number]
            to = self.owner(rng.choice(others))
            body = {**lease, "to": to, "accept_within_ms": self.mix.accept_within_ms}
            handed = await self._command(rng, "handoff", resource, body)
            if handed is not None and handed.ok:
                self._mailboxes[to].put_nowait(Offer(resource, owner))
                return
        await self._command(rng, "release", resource, lease)

    async def _route(self, rng: random.Random, owner: str, rid: str) -> None:
        route = rng.sample(self.resources, rng.randint(2, 3))
        self.requested[rid] = frozenset(route)
        body = {
            "owner": owner,
            "resources": route,
            "reservation_id": rid,
            "ttl_ms": self.mix.ttl_ms,
            "wait_ms": rng.choice(self.mix.waits_ms),
        }
        reserved = await self._command(rng, "reserve", "+".join(route), body)
        if reserved is None or not reserved.ok or reserved.response is None:
            return
        leases = [
            {"resource": lease["resource"], "fencing_token": lease["fencing_token"]}
            for lease in reserved.response["leases"]
        ]
        await self._hold(rng)
        if rng.random() < 0.5:
            renewed = await self._command(rng, "reserve-renew", rid, {"owner": owner, "leases": leases})
            if renewed is None or not renewed.ok:
                return
            await self._hold(rng)
        parts = [[lease] for lease in leases] if rng.random() < 0.5 else [leases]
        for part in parts:
            released = await self._command(rng, "reserve-release", rid, {"owner": owner, "leases": part})
            if released is None or not released.ok:
                return
            await self._hold(rng)

    async def _shared(self, rng: random.Random, owner: str) -> None:
        """A reader's or writer's grant of the read/write lock, or a permit of the semaphore."""
        if rng.random() < self.mix.permit:
            kind, stream, mode, limit = "permit", self.semaphore, "shared", self.mix.permits
        elif rng.random() < self.mix.write:
            kind, stream, mode, limit = "write", self.rw_lock, "exclusive", None
        else:
            kind, stream, mode, limit = "read", self.rw_lock, "shared", None
        body = {
            "owner": owner,
            "mode": mode,
            "limit": limit,
            "ttl_ms": self.mix.ttl_ms,
            "wait_ms": rng.choice(self.mix.waits_ms),
        }
        acquired = await self._command(rng, "shared-acquire", stream, body)
        if acquired is None or not acquired.ok or acquired.response is None:
            return
        self.granted[kind] += 1
        grant = {"owner": owner, "fencing_token": acquired.response["fencing_token"]}
        await asyncio.sleep(rng.uniform(0, self.mix.shared_hold_s))
        if rng.random() < 0.5:
            renewed = await self._command(rng, "shared-renew", stream, grant)
            if renewed is None or not renewed.ok:
                return
            await asyncio.sleep(rng.uniform(0, self.mix.shared_hold_s))
        await self._command(rng, "shared-release", stream, grant)

    async def _hold(self, rng: random.Random) -> None:
        await asyncio.sleep(rng.uniform(0, self.mix.hold_s))

    # --- one command, retried -----------------------------------------------------------------------

    async def _command(
        self, rng: random.Random, command: str, target: str, body: dict[str, Any]
    ) -> Operation | None:
        """One logical command under one Idempotency-Key, retried on the next server while its outcome is
        unknown. Returns the last request's operation, or None if the load stopped before it was sent."""
        if self._stopping.is_set():
            return None
        key = str(uuid.uuid4())
        server = rng.randrange(len(self._clients))
        operation: Operation | None = None
        for attempt in range(1, self.mix.attempts + 1):
            if attempt > 1:
                pause = min(self.mix.backoff_s * 2 ** (attempt - 2), 1.2)
                if time.monotonic() + pause > self._retry_until:
                    break
                await asyncio.sleep(pause)
                server = (server + 1) % len(self._clients)
            operation = await self._send(server, command, target, body, key, attempt)
            if not operation.indeterminate:
                break
        if operation is not None and operation.ok:
            self.done[command] += 1
        return operation

    async def _send(
        self, server: int, command: str, target: str, body: dict[str, Any], key: str, attempt: int
    ) -> Operation:
        operation = self.history.invoke(
            client=str(body["owner"]), command=command, resource=target, body=body, key=key, attempt=attempt
        )
        return await post_recorded(
            self._clients[server], _path(command, target), body, key, self.history, operation
        )


def _path(command: str, target: str) -> str:
    if command.startswith("shared-"):  # the target is the lock's stream, shared/<resource>
        return f"/v1/shared-locks/{target.removeprefix('shared/')}/{command.removeprefix('shared-')}"
    if command == "reserve":
        return "/v1/reservations"
    if command.startswith("reserve-"):
        return f"/v1/reservations/{target}/{command.removeprefix('reserve-')}"
    return f"/v1/locks/{target}/{command}"


# What a database restart throws at a client (asyncpg's InternalClientError: a connection left mid-operation).
_GONE = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)


class QueueWatcher:
    """Reads ``lock_queue`` every few milliseconds while the load runs and keeps every ticket it saw under
    the prefix (a grant deletes its ticket, so the log alone does not say who waited, nor since when).
    Survives a database restart: it reconnects and goes on."""

    def __init__(self, database_url: str, prefix: str, interval_s: float = 0.01) -> None:
        self.database_url = database_url
        self.prefix = prefix
        self.interval_s = interval_s
        self.tickets: dict[int, QueuedTicket] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> QueueWatcher:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _watch(self) -> None:
        while True:
            try:
                conn = await asyncpg.connect(asyncpg_dsn(self.database_url), timeout=2)
            except _GONE:
                await asyncio.sleep(0.1)
                continue
            try:
                while True:
                    for ticket in await read_queue(conn, self.prefix):
                        self.tickets.setdefault(ticket.ticket, ticket)
                    await asyncio.sleep(self.interval_s)
            except _GONE:
                await asyncio.sleep(0.1)
            finally:
                with contextlib.suppress(Exception):
                    await conn.close(timeout=1)
