"""The lockledger HTTP client, in two packages: ``lockledger/_async`` (asyncio) is the source, and
``lockledger/_sync`` (blocking) is generated from it by ``scripts/generate_sync.py``, so the two cannot
drift.

Why the shape: every command carries an Idempotency-Key chosen *before* the first attempt, so a retry
after a lost response replays the stored answer instead of taking a second lock or releasing twice.
Retries (stamina: jittered exponential backoff, bounded by attempts and total time) cover only what a
retry can fix: transport errors, timeouts and 5xx. A 4xx is the server's considered answer and is raised
at once as a typed exception. Every attempt passes through a circuit breaker first, so while the service
is down calls fail in microseconds with ``CircuitOpen`` and no network I/O. A transport error (connection
refused, reset, timed out) that outlasts the retries is raised as ``Unavailable``, like a 503, with the
httpx error as its cause: callers catch the SDK's exceptions, never httpx's.

Durations are seconds as floats everywhere in this API (``ttl``, ``wait``, ``timeout``, ``retry_timeout``,
``expiring_within``, ``LeaseInfo.ttl``), as in httpx and asyncio; the server's ``*_ms`` fields are
converted to and from at the HTTP boundary only (``lockledger.wire``). Instants (the replay API's ``at``,
``from_``, ``to``) are aware datetimes or RFC 3339 strings with an offset, never naive ones.

The export (``export``) and the change feed (``watch``) are streamed: one event at a time, and a
connection cut mid-stream is resumed after the last event yielded, a bounded number of times in a row.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, Self

import httpx

from lockledger import wire
from lockledger.errors import LockLost
from lockledger.event import Event
from lockledger.feed import FeedOverflow, SseParser, feed_event
from lockledger.lease import AsyncLease
from lockledger.records import (
    ForceReleased,
    HandedOff,
    History,
    LeaseInfo,
    LockInfo,
    LockPage,
    Released,
    Reply,
)
from lockledger.replay import AgentHistory, Change, Changes, ReplayLease, ReplayState, filters, time_range
from lockledger.reservation import AsyncReservation, ReservationInfo, leases_field
from lockledger.saga import AsyncSaga, SagaDefinition, SagaView
from lockledger_breaker import CircuitBreaker

__all__ = ["AsyncClient"]


class AsyncClient(wire.ClientCore):
    """The client. Use ``async with AsyncClient(url) as c:``; ``c.lock(...)`` for managed leases, renewed
    in the background until their block ends."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        retry_attempts: int = 5,
        retry_timeout: float = 10.0,
        breaker: CircuitBreaker | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
        agent_id: str | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(
            retry_attempts=retry_attempts,
            retry_timeout=retry_timeout,
            breaker=breaker,
            agent_id=agent_id,
            token=token,
        )
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=transport, headers=self._auth(headers, token)
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        wait: float = 0.0,
    ) -> Reply:
        """One call of the HTTP API (``path`` under the base URL), with the client's retries, breaker and
        typed errors: the layer every method here, and sagas, are built on. A POST carries
        ``idempotency_key`` on every attempt (a fresh one if None); ``wait`` (seconds) is how long the
        server may hold the answer back (a waiting acquire), added to the read timeout."""
        sent = wire.request_headers(method, headers, idempotency_key)
        timeout = wire.waiting_timeout(self._http.timeout, wait)
        try:
            async for attempt in self._retries(wait):
                with attempt:
                    self.breaker.acquire_permission()  # CircuitOpen here: nothing was sent
                    started = time.monotonic()
                    try:
                        response = await self._http.request(
                            method, path, json=json, params=params, headers=sent, timeout=timeout
                        )
                    except BaseException as exc:
                        self._failed(exc, started, wait)
                        raise
                    settled = self._settle(response, started, wait)
                    return Reply(settled.json(), wire.replayed(settled))
        except httpx.TransportError as exc:
            raise wire.unreachable(exc, method, path) from exc
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def _data(self, method: str, path: str, **kwargs: Any) -> Any:
        reply = await self.request(method, path, **kwargs)
        return reply.data

    async def acquire(
        self, resource: str, owner: str | None = None, ttl: float | None = None, wait: float = 0.0
    ) -> LeaseInfo:
        """Take the lock for ``ttl`` seconds (the server's default, 30 s, if None); if it is held, the
        server waits up to ``wait`` seconds (at most its ``LOCKLEDGER_MAX_WAIT_MS``) for it to come free
        before raising ``LockHeld``."""
        path = wire.lock_path(resource, "/acquire")
        body = wire.acquire_body(owner, ttl, wait)
        return LeaseInfo.from_json(await self._data("POST", path, json=body, wait=wait))

    async def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl: float | None = None
    ) -> LeaseInfo:
        """Extend the lease to ``ttl`` seconds from now (the lease's current length if None)."""
        path = wire.lock_path(resource, "/renew")
        body = wire.renew_body(owner, fencing_token, ttl)
        return LeaseInfo.from_json(await self._data("POST", path, json=body))

    async def release(self, resource: str, owner: str | None, fencing_token: int) -> Released:
        path = wire.lock_path(resource, "/release")
        body = wire.release_body(owner, fencing_token)
        return Released.from_json(await self._data("POST", path, json=body))

    async def acquire_shared(
        self,
        resource: str,
        mode: str = "exclusive",
        limit: int | None = None,
        owner: str | None = None,
        ttl: float | None = None,
        wait: float = 0.0,
    ) -> LeaseInfo:
        """A grant of the shared lock ``resource`` (``/v1/shared-locks``, a lock of its own beside the mutex
        of that name): ``mode`` ``shared`` (a reader, or a permit under ``limit``) or ``exclusive`` (a
        writer); the server waits up to ``wait`` seconds for a place before raising ``LockHeld``."""
        path = wire.shared_path(resource, "/acquire")
        body = wire.shared_acquire_body(mode, limit, owner, ttl, wait)
        return LeaseInfo.from_json(await self._data("POST", path, json=body, wait=wait))

    async def renew_shared(
        self, resource: str, owner: str | None, fencing_token: int, ttl: float | None = None
    ) -> LeaseInfo:
        """Extend the shared lock's grant ``fencing_token`` to ``ttl`` seconds from now."""
        path = wire.shared_path(resource, "/renew")
        body = wire.renew_body(owner, fencing_token, ttl)
        return LeaseInfo.from_json(await self._data("POST", path, json=body))

    async def release_shared(self, resource: str, owner: str | None, fencing_token: int) -> Released:
        path = wire.shared_path(resource, "/release")
        body = wire.release_body(owner, fencing_token)
        return Released.from_json(await self._data("POST", path, json=body))

    async def get_shared_lock(self, resource: str) -> dict[str, Any]:
        """The shared lock's live grants (``holders``), ``limit`` and ``queue``, as the API shows them."""
        result: dict[str, Any] = await self._data("GET", wire.shared_path(resource))
        return result

    async def reserve_set(
        self,
        resources: list[str],
        owner: str | None = None,
        ttl: float | None = None,
        wait: float = 0.0,
        reservation_id: str | None = None,
    ) -> ReservationInfo:
        """Take every resource for ``ttl`` seconds, all or none, each with its own fencing token; while any
        is held, the server waits up to ``wait`` seconds (holding none) before raising ``LockHeld``, whose
        ``problem["conflicts"]`` names every held resource and holder."""
        body: dict[str, Any] = {
            "resources": [wire.check_resource(resource) for resource in resources],
            **wire.acquire_body(owner, ttl, wait),
        }
        if reservation_id is not None:
            body["reservation_id"] = reservation_id
        return ReservationInfo.from_json(await self._data("POST", "/v1/reservations", json=body, wait=wait))

    async def renew_reservation(
        self, reservation_id: str, owner: str | None, tokens: Mapping[str, int], ttl: float | None = None
    ) -> ReservationInfo:
        """Renew every lease in ``tokens`` (resource -> fencing token) to one deadline, or none."""
        body = {**wire.owner_field(owner), "leases": leases_field(tokens), **wire.ttl_field(ttl)}
        path = f"/v1/reservations/{reservation_id}/renew"
        return ReservationInfo.from_json(await self._data("POST", path, json=body))

    async def release_reservation(
        self, reservation_id: str, owner: str | None, tokens: Mapping[str, int]
    ) -> ReservationInfo:
        """End every lease in ``tokens`` (the set, or the one resource left), or none."""
        body = {**wire.owner_field(owner), "leases": leases_field(tokens)}
        path = f"/v1/reservations/{reservation_id}/release"
        return ReservationInfo.from_json(await self._data("POST", path, json=body))

    async def handoff(
        self,
        resource: str,
        owner: str | None,
        fencing_token: int,
        to: str,
        accept_within: float | None = None,
    ) -> HandedOff:
        """Pass the live lease to the agent ``to`` in one step: ``to`` holds it at once with a higher
        fencing token and must ``accept`` within ``accept_within`` seconds (the server's default TTL if
        None); ``fencing_token`` is refused from now on."""
        path = wire.lock_path(resource, "/handoff")
        body = wire.handoff_body(owner, fencing_token, to, accept_within)
        return HandedOff.from_json(await self._data("POST", path, json=body))

    async def accept(self, resource: str, owner: str | None = None, ttl: float | None = None) -> LeaseInfo:
        """Take up the lease handed to this agent: renewed for ``ttl`` seconds (the server's default if
        None), its fencing token returned. Once per hand-off: ``NotHolder`` when none awaits this agent,
        ``LeaseExpired`` once its deadline has passed. Renew it from then on, or use ``accept_lock``."""
        path = wire.lock_path(resource, "/accept")
        body = {**wire.owner_field(owner), **wire.ttl_field(ttl)}
        return LeaseInfo.from_json(await self._data("POST", path, json=body))

    async def decline(self, resource: str, owner: str | None = None) -> Released:
        """Refuse the lease handed to this agent: it is released now."""
        path = wire.lock_path(resource, "/decline")
        return Released.from_json(await self._data("POST", path, json=wire.owner_field(owner)))

    async def force_release(self, resource: str, reason: str) -> ForceReleased:
        path = wire.lock_path(resource, "/force-release")
        return ForceReleased.from_json(await self._data("POST", path, json={"reason": reason}))

    async def get_lock(self, resource: str) -> LockInfo:
        """The lock's state; ``NotFound`` if it was never locked."""
        return LockInfo.from_json(await self._data("GET", wire.lock_path(resource)))

    async def list_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within: float | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> LockPage:
        """One page of live leases; ``expiring_within`` (seconds): only those whose deadline is that near."""
        params = wire.locks_query(holder, prefix, expiring_within, cursor, limit)
        data = await self._data("GET", "/v1/locks", params=params)
        return LockPage([LockInfo.from_json(i) for i in data["items"]], data["next_cursor"])

    async def iter_locks(
        self,
        *,
        holder: str | None = None,
        prefix: str | None = None,
        expiring_within: float | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[LockInfo]:
        """Every live lease matching the filters, following ``next_cursor`` page by page."""
        cursor: str | None = None
        while True:
            page = await self.list_locks(
                holder=holder,
                prefix=prefix,
                expiring_within=expiring_within,
                cursor=cursor,
                limit=limit,
            )
            for item in page.items:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def history(
        self,
        resource: str,
        after_version: int = 0,
        limit: int = 100,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
        shared: bool = False,
    ) -> History:
        """One page of the resource's events in version order, after ``after_version``; with ``from_`` or
        ``to``, only those recorded in ``[from_, to)``. ``next_after_version`` continues it (None: done).
        ``shared=True``: the shared lock of that name (its grants, stream ``shared/<resource>``) instead
        of the mutex."""
        params = {"after_version": after_version, "limit": limit, **time_range(from_, to)}
        path = (wire.shared_path if shared else wire.lock_path)(resource, "/history")
        return History.from_json(await self._data("GET", path, params=params), shared=shared)

    async def agent_history(
        self,
        owner: str,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
        after_position: int = 0,
        limit: int = 100,
    ) -> AgentHistory:
        """One page of an agent's events across every resource, in log order, after ``after_position``,
        recorded in ``[from_, to)``. ``next_after_position`` continues it (None: done)."""
        params = {"after_position": after_position, "limit": limit, **time_range(from_, to)}
        path = f"/v1/agents/{wire.check_owner(owner)}/history"
        return AgentHistory.from_json(await self._data("GET", path, params=params))

    async def replay_state(
        self, at: datetime | str, *, prefix: str | None = None, owner: str | None = None
    ) -> ReplayState:
        """Every lease live at the past instant ``at`` (all pages), by resource. ``ValidationError`` for a
        future instant."""
        query = wire.state_query(at, prefix, owner)
        first: dict[str, Any] | None = None
        locks: list[ReplayLease] = []
        cursor: str | None = None
        while True:
            params = {**query, **filters(cursor=cursor)}
            data = await self._data("GET", "/v1/replay/state", params=params)
            first = first or data
            locks += [ReplayLease.from_json(item) for item in data["locks"]]
            cursor = data["next_cursor"]
            if cursor is None:
                return ReplayState.from_json(first, locks)

    async def changes(
        self,
        from_: datetime | str,
        to: datetime | str,
        *,
        prefix: str | None = None,
        owner: str | None = None,
    ) -> Changes:
        """Everything that changed after ``from_`` up to ``to`` (all pages), in time order."""
        query = wire.changes_query(from_, to, prefix, owner)
        first: dict[str, Any] | None = None
        found: list[Change] = []
        cursor: str | None = None
        while True:
            params = {**query, **filters(cursor=cursor)}
            data = await self._data("GET", "/v1/replay/changes", params=params)
            first = first or data
            found += [Change.from_json(item) for item in data["changes"]]
            cursor = data["next_cursor"]
            if cursor is None:
                return Changes.from_json(first, found)

    async def export(
        self,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
        after_position: int = 0,
        type: str | None = None,
        owner: str | None = None,
        prefix: str | None = None,
    ) -> AsyncIterator[Event]:
        """Every matching event after ``after_position`` recorded in ``[from_, to)``, in position order,
        streamed (memory stays flat). A cut connection is resumed after the last event yielded; once
        ``retry_attempts`` connections in a row are cut before yielding any event, ``Unavailable``. Exhaust
        or close the iterator: it holds a connection until then."""
        query = wire.export_query(from_, to, type, owner, prefix)
        position, cuts = after_position, 0
        while True:
            response = await self._open_stream("/v1/events", {**query, "after_position": position}, {})
            resumed_at = position
            try:
                async for line in response.aiter_lines():
                    if line.strip():
                        event = Event.from_line(line)
                        position = event.position
                        yield event
                return
            except (httpx.TransportError, ValueError) as exc:  # ValueError: a line cut in two
                cuts = 0 if position != resumed_at else cuts + 1
                if cuts >= self.retry_attempts:
                    raise wire.export_cut_off(exc, position, cuts) from exc
            finally:
                await response.aclose()

    async def watch(
        self,
        after_position: int | None = None,
        *,
        prefix: str | None = None,
        owner: str | None = None,
        type: str | None = None,
        saga: str | None = None,
        last_event_id: str | None = None,
    ) -> AsyncIterator[Event]:
        """The change feed (``GET /v1/events/stream``): every matching event once, as it is committed,
        from ``after_position`` (or ``last_event_id``, an ``Event.id`` from the feed) or from now; never
        ends by itself. A cut connection, or the server's ``overflow`` for a client too slow, is resumed
        with ``Last-Event-ID`` = the last id received; once ``retry_attempts`` connections in a row end
        before a new event, ``Unavailable``."""
        query = filters(prefix=prefix or None, owner=owner or None, type=type or None, saga=saga or None)
        if after_position is not None:
            query["after_position"] = after_position
        place, cuts = last_event_id, 0
        while True:
            headers = {"Last-Event-ID": place} if place is not None else {}
            response = await self._open_stream("/v1/events/stream", query, headers)
            resumed_at = place
            parser = SseParser()
            try:
                async for line in response.aiter_lines():
                    message = parser.feed(line)
                    if message is None:
                        continue
                    if message.event == "overflow":
                        place = FeedOverflow.from_message(message).last_event_id or place
                        break
                    event = feed_event(message)
                    place = event.id
                    yield event
            except (httpx.TransportError, ValueError):  # ValueError: a message cut in two
                pass
            finally:
                await response.aclose()
            cuts = 0 if place != resumed_at else cuts + 1
            if cuts >= self.retry_attempts:
                raise wire.feed_cut_off(cuts, place)

    async def _open_stream(
        self, path: str, params: dict[str, Any], headers: dict[str, str]
    ) -> httpx.Response:
        """A GET whose body is left to read: retried and guarded by the breaker like ``request`` up to the
        response head. The caller closes it."""
        timeout = wire.streaming_timeout(self._http.timeout)
        try:
            async for attempt in self._retries():
                with attempt:
                    self.breaker.acquire_permission()
                    started = time.monotonic()
                    try:
                        request = self._http.build_request(
                            "GET", path, params=params, headers=headers, timeout=timeout
                        )
                        response = await self._http.send(request, stream=True)
                        if response.is_error:  # the problem body, read whole, for the typed error
                            try:
                                await response.aread()
                            finally:
                                await response.aclose()
                    except BaseException as exc:
                        self._failed(exc, started)
                        raise
                    return self._settle(response, started)
        except httpx.TransportError as exc:
            raise wire.unreachable(exc, "GET", path) from exc
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._data("GET", "/healthz")
        return result

    async def ready(self) -> dict[str, Any]:
        """``{"status": "ready"}``, or ``Unavailable`` (after retries) while the database is down."""
        result: dict[str, Any] = await self._data("GET", "/readyz")
        return result

    def lock(
        self,
        resource: str,
        *,
        owner: str | None = None,
        ttl: float = 30.0,
        wait: float = 0.0,
        on_lost: Callable[[LockLost], None] | None = None,
        safety_margin: float = 0.1,
    ) -> AsyncLease:
        """A managed lease: ``async with client.lock("zone:A3", ttl=30, wait=5) as lease:`` (seconds).

        See ``lockledger.lease`` for the renewal and loss rules; ``safety_margin`` is a fraction of ``ttl``.
        """
        resource = wire.check_resource(resource)
        return AsyncLease(self, resource, owner or self.agent_id, ttl, wait, on_lost, safety_margin)

    def read_lock(
        self,
        resource: str,
        *,
        owner: str | None = None,
        ttl: float = 30.0,
        wait: float = 0.0,
        on_lost: Callable[[LockLost], None] | None = None,
        safety_margin: float = 0.1,
    ) -> AsyncLease:
        """A managed shared grant of a read/write lock: ``async with client.read_lock("zone:A3") as lease:``.
        Readers hold together; a waiting writer goes first. Renewed and released as ``lock``'s lease is."""
        commands = SharedCommands(self, "shared", None)
        return AsyncLease(
            commands, wire.check_resource(resource), owner or self.agent_id, ttl, wait, on_lost, safety_margin
        )

    def write_lock(
        self,
        resource: str,
        *,
        owner: str | None = None,
        ttl: float = 30.0,
        wait: float = 0.0,
        on_lost: Callable[[LockLost], None] | None = None,
        safety_margin: float = 0.1,
    ) -> AsyncLease:
        """A managed exclusive grant of a read/write lock (no reader holds with it):
        ``async with client.write_lock("zone:A3") as lease:``."""
        commands = SharedCommands(self, "exclusive", None)
        return AsyncLease(
            commands, wire.check_resource(resource), owner or self.agent_id, ttl, wait, on_lost, safety_margin
        )

    def semaphore(
        self,
        resource: str,
        limit: int,
        *,
        owner: str | None = None,
        ttl: float = 30.0,
        wait: float = 0.0,
        on_lost: Callable[[LockLost], None] | None = None,
        safety_margin: float = 0.1,
    ) -> AsyncLease:
        """A managed permit of a semaphore of ``limit`` permits: ``async with client.semaphore("bay:charging",
        limit=4) as permit:``. Every holder names the same limit (409 ``limit_mismatch`` otherwise)."""
        commands = SharedCommands(self, "shared", limit)
        return AsyncLease(
            commands, wire.check_resource(resource), owner or self.agent_id, ttl, wait, on_lost, safety_margin
        )

    def reserve(
        self,
        resources: list[str],
        *,
        owner: str | None = None,
        ttl: float = 30.0,
        wait: float = 0.0,
        reservation_id: str | None = None,
        on_lost: Callable[[LockLost], None] | None = None,
        safety_margin: float = 0.1,
    ) -> AsyncReservation:
        """A managed reservation: ``async with client.reserve(["zone:A1", "zone:A2"], ttl=30) as r:``.

        Every resource or none; one heartbeat for the set; ``r.release("zone:A1")`` ends one lease, the
        block's exit the rest. See ``lockledger.reservation`` for the renewal and loss rules.
        """
        checked = [wire.check_resource(resource) for resource in resources]
        return AsyncReservation(
            self, checked, owner or self.agent_id, ttl, wait, reservation_id, on_lost, safety_margin
        )

    def accept_lock(
        self,
        resource: str,
        *,
        owner: str | None = None,
        ttl: float = 30.0,
        on_lost: Callable[[LockLost], None] | None = None,
        safety_margin: float = 0.1,
    ) -> AsyncLease:
        """A managed lease taken up from a hand-off: ``async with client.accept_lock("pallet:42") as
        lease:`` accepts on entry (``NotHolder`` if no hand-off awaits), then renews and releases as
        ``lock`` does."""
        resource = wire.check_resource(resource)
        return AsyncLease(self, resource, owner or self.agent_id, ttl, 0.0, on_lost, safety_margin, True)

    def saga(
        self,
        saga_id: str | None,
        definition: SagaDefinition | str | None = None,
        *,
        name: str | None = None,
        params: Mapping[str, Any] | None = None,
        owner: str | None = None,
        lease: float = 30.0,
    ) -> AsyncSaga:
        """A saga of ``definition`` (or of the registered definition ``name``), its lock templates filled
        from ``params``: ``async with client.saga("move-42", name="pallet-to-zone", params=...) as saga:``.
        The saga's own ``lease`` (seconds) is heartbeated every third of it while the block runs; if the
        heartbeats stop, the server compensates the saga. See ``lockledger.saga``."""
        return AsyncSaga(self, saga_id, definition or name, params, owner, lease)

    async def recover_sagas(
        self,
        definitions: Iterable[SagaDefinition] | Mapping[str, SagaDefinition] | None = None,
        *,
        owner: str | None = None,
    ) -> list[SagaView]:
        """Finish this agent's unfinished sagas from the server's log alone (forward or compensated, as
        each definition's ``policy`` says; definitions by name, default the registry)."""
        return await AsyncSaga.recover_all(self, definitions, owner)


class SharedCommands:
    """What a shared lock's managed lease sends its commands through (``AsyncLease``'s commands): a
    client's shared-lock calls with the grant's ``mode`` and ``limit`` fixed, so the mutex's lease, its
    heartbeat, watchdog and loss rules serve read locks, write locks and semaphores unchanged."""

    def __init__(self, client: AsyncClient, mode: str, limit: int | None) -> None:
        self._client = client
        self.mode = mode
        self.limit = limit
        self.retry_timeout = client.retry_timeout  # how long the blocking lease's release may retry

    async def acquire(
        self, resource: str, owner: str | None = None, ttl: float | None = None, wait: float = 0.0
    ) -> LeaseInfo:
        return await self._client.acquire_shared(resource, self.mode, self.limit, owner, ttl, wait)

    async def renew(
        self, resource: str, owner: str | None, fencing_token: int, ttl: float | None = None
    ) -> LeaseInfo:
        return await self._client.renew_shared(resource, owner, fencing_token, ttl)

    async def release(self, resource: str, owner: str | None, fencing_token: int) -> Released:
        return await self._client.release_shared(resource, owner, fencing_token)
