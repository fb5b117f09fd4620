"""Concurrent lock traffic for the fault scenarios: many agents contending for a few resources.

Each client is an agent that loops acquire -> 0..n renews -> release (or walks away and lets the lease
lapse), on a resource drawn from a small set so that commands collide. Every command carries its own
Idempotency-Key and, like a careful SDK, is retried under that same key while its outcome is unknown
(timeout, broken connection, 5xx), so a fault turns into retries the service must not apply twice. With
``duplicate``/``late_duplicate`` set, some requests are also sent again under the same key, at once or
after a delay, as a network that duplicates and delays packets would.

Every request, retry and duplicate goes through :class:`~tests.faults.history.History`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from tests.faults.history import History, Operation

# A scenario that got fewer commands acknowledged than this tested too little to count (the runs here get
# 150-400; a service that stops serving gets almost none).
MIN_ACKED = 50

# ``Operation.copy`` of deliberate duplicates: sent 0-30 ms after the request, or late.
CONCURRENT_COPY = 1
LATE_COPY = 2


@dataclass(frozen=True)
class Request:
    """One logical command as sent, under its Idempotency-Key; every attempt and copy resends it."""

    owner: str
    command: str
    resource: str
    body: dict[str, Any]
    key: str


@dataclass(frozen=True)
class LoadProfile:
    """The shape of the traffic. The defaults keep about two agents per resource, so acquires collide
    and leases change hands several times a second, and TTLs short enough (1-3 s) that a fault of a
    second or two makes leases lapse mid-cycle."""

    clients: int = 24
    ttl_ms: tuple[int, ...] = (1_000, 2_000, 3_000)
    max_renews: int = 3
    renew_at: float = 0.2  # a renewal comes up to this share of the TTL after the previous command
    think_s: float = 0.05  # longest pause between two commands of one client
    abandon: float = 0.0  # share of leases left to lapse instead of being released
    attempts: int = 6  # requests per command while its outcome stays unknown
    backoff_s: float = 0.15  # first pause before a retry; doubles, capped at 1.2 s
    timeout_s: float = 5.0  # per request
    duplicate: float = 0.0  # chance that a request is sent a second time at once (0-30 ms later)
    late_duplicate: float = 0.0  # chance that it is sent once more, late
    late_delay_s: tuple[float, float] = (0.3, 2.0)
    grace_s: float = 6.0  # how long retries may go on after the load was told to stop


class Load:
    """``start()`` the clients, inject faults meanwhile, then ``stop()``: every task is awaited."""

    def __init__(
        self,
        base_url: str,
        resources: list[str],
        history: History,
        profile: LoadProfile | None = None,
        seed: int = 0,
        agents: str = "agent",
    ) -> None:
        self.base_url = base_url
        self.agents = agents  # the owners' prefix: loads sharing resources through two servers differ
        self.resources = resources
        self.history = history
        self.profile = profile or LoadProfile()
        self.seed = seed
        self._stopping = asyncio.Event()
        self._retry_until = float("inf")
        self._clients: list[asyncio.Task[None]] = []
        self._copies: set[asyncio.Task[None]] = set()
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        connections = self.profile.clients * 3
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self.profile.timeout_s,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )
        self._clients = [
            asyncio.create_task(self._client(n), name=f"client-{n}") for n in range(self.profile.clients)
        ]

    async def stop(self) -> None:
        """Let every client finish its command in hand (retries included, within the grace period), then
        wait for the last late duplicates; cancel whatever is still running after that."""
        self._stopping.set()
        self._retry_until = time.monotonic() + self.profile.grace_s
        deadline = time.monotonic() + self.profile.grace_s + 2 * self.profile.timeout_s + 2
        finished: list[asyncio.Task[None]] = []
        # Clients first (they may still start duplicates while finishing), then the duplicates in flight.
        groups: tuple[list[asyncio.Task[None]] | set[asyncio.Task[None]], ...] = (self._clients, self._copies)
        for group in groups:
            while tasks := [task for task in list(group) if task not in finished]:
                _, pending = await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0.01))
                for task in pending:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                finished += tasks
        if self._http is not None:
            await self._http.aclose()
        for task in finished:
            if not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"{task.get_name()} failed") from task.exception()

    async def __aenter__(self) -> Load:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def command(
        self, owner: str, command: str, resource: str, body: dict[str, Any]
    ) -> Operation | None:
        """One command outside the clients' loops (a scenario's own probe), recorded and retried the same
        way."""
        return await self._command(random.Random(self.seed), owner, command, resource, body)

    async def _client(self, number: int) -> None:
        rng = random.Random(self.seed * 1_000 + number)
        owner = f"{self.agents}{number:02d}"
        profile = self.profile
        while not self._stopping.is_set():
            resource = rng.choice(self.resources)
            ttl_ms = rng.choice(profile.ttl_ms)
            acquired = await self._command(
                rng, owner, "acquire", resource, {"owner": owner, "ttl_ms": ttl_ms}
            )
            if acquired is None or acquired.status != 201 or acquired.response is None:
                await asyncio.sleep(rng.uniform(0, profile.think_s))
                continue
            token = acquired.response["fencing_token"]
            lease = {"owner": owner, "fencing_token": token}
            still_held = True
            for _ in range(rng.randint(0, profile.max_renews)):
                await asyncio.sleep(rng.uniform(0, ttl_ms / 1000 * profile.renew_at))
                renewed = await self._command(rng, owner, "renew", resource, lease)
                if renewed is None or not renewed.ok:
                    still_held = False
                    break
            if still_held and rng.random() >= profile.abandon:
                await asyncio.sleep(rng.uniform(0, profile.think_s))
                await self._command(rng, owner, "release", resource, lease)

    async def _command(
        self, rng: random.Random, owner: str, command: str, resource: str, body: dict[str, Any]
    ) -> Operation | None:
        """One logical command under one Idempotency-Key, retried while its outcome is unknown.

        Returns the last request's operation, or None if the load stopped before it was sent."""
        if self._stopping.is_set():
            return None
        request = Request(owner, command, resource, body, str(uuid.uuid4()))
        profile = self.profile
        operation: Operation | None = None
        for attempt in range(1, profile.attempts + 1):
            if attempt > 1:
                pause = min(profile.backoff_s * 2 ** (attempt - 2), 1.2)
                if time.monotonic() + pause > self._retry_until:
                    break
                await asyncio.sleep(pause)
            self._maybe_duplicate(rng, request, attempt)
            operation = await self._send(request, attempt, copy=0)
            if not operation.indeterminate:
                break
        return operation

    def _maybe_duplicate(self, rng: random.Random, request: Request, attempt: int) -> None:
        delays: dict[int, float] = {}
        if rng.random() < self.profile.duplicate:
            delays[CONCURRENT_COPY] = rng.uniform(0, 0.03)
        if rng.random() < self.profile.late_duplicate:
            delays[LATE_COPY] = rng.uniform(*self.profile.late_delay_s)
        for copy, delay in delays.items():
            task = asyncio.create_task(self._copy(delay, request, attempt, copy))
            self._copies.add(task)
            task.add_done_callback(self._copies.discard)

    async def _copy(self, delay: float, request: Request, attempt: int, copy: int) -> None:
        await asyncio.sleep(delay)
        fault = "late_duplicate" if copy == LATE_COPY else "duplicate"
        self.history.fault(fault, f"{request.command} {request.key}")
        await self._send(request, attempt, copy)

    async def _send(self, request: Request, attempt: int, copy: int) -> Operation:
        assert self._http is not None
        operation = self.history.invoke(
            client=request.owner,
            command=request.command,
            resource=request.resource,
            body=request.body,
            key=request.key,
            attempt=attempt,
            copy=copy,
        )
        path = f"/v1/locks/{request.resource}/{request.command}"
        return await post_recorded(self._http, path, request.body, request.key, self.history, operation)


async def post_recorded(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    key: str,
    history: History,
    operation: Operation,
) -> Operation:
    """POST a command under its Idempotency-Key and record in ``history`` what came back: the answer, or
    the transport error that left its outcome unknown."""
    try:
        response = await client.post(path, json=body, headers={"Idempotency-Key": key})
    except httpx.TransportError as error:  # timeouts, refused and broken connections
        history.lose(operation, type(error).__name__)
        return operation
    payload: Any = None
    with contextlib.suppress(ValueError):
        payload = response.json()
    replayed = response.headers.get("Idempotent-Replayed") == "true"
    history.respond(operation, response.status_code, payload, replayed=replayed)
    return operation
