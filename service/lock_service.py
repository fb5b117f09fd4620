"""Command handlers: load, decide, append, and on a lost race load and decide again (bounded)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
from prometheus_client import Counter, Histogram

from domain.commands import Acquire, Command, Expire, ForceRelease, Release, Renew
from domain.decider import decide, fold
from domain.errors import DomainError
from domain.events import Event, LockForceReleased
from domain.resource import TtlBounds
from domain.state import LockState, initial_state
from domain.value import value
from service import lock_store
from service.appends_in_flight import AppendsInFlight
from service.coalescer import LATE_FACTOR, Coalescer
from service.database import connection
from service.database_guard import STALLED, DatabaseGuard, is_unreachable
from service.errors import Unavailable
from service.idempotency import fingerprint, replay
from service.lock_store import AppendPlan, Committed, Idempotency, Snapshot
from service.state_cache import NewStreamGuess, StateCache
from service.waiters import Waiters

_LoadRequest = tuple[str, str, str | None]  # resource, principal, Idempotency-Key

# Whether remembering pays, per process, on /metrics: commands appended straight from memory, those whose
# memory proved stale (and read after all), and every read before a decision.
_FROM_MEMORY = Counter(
    "lockledger_commands_from_memory_total",
    "Commands decided on a remembered lock state: appended at once, or refused as stale and read again",
    ["outcome"],
)
_APPENDED_FROM_MEMORY = _FROM_MEMORY.labels("appended")
_STALE_MEMORY = _FROM_MEMORY.labels("stale")
_READS = Counter("lockledger_command_reads_total", "Commands that read their lock's state before deciding")

# Where a command's time goes, per process: how many commands share a database round trip, and how long
# the round trip takes (pool wait and retries included), for reads and for appends.
_BATCH_SIZE = Histogram(
    "lockledger_db_batch_size",
    "Commands answered by one database round trip",
    ["kind"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
_BATCH_SECONDS = Histogram(
    "lockledger_db_batch_seconds",
    "Time from a batch leaving for the database to its answer",
    ["kind"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


def _batch_observer(kind: str) -> Callable[[int, float], None]:
    size = _BATCH_SIZE.labels(kind)
    seconds = _BATCH_SECONDS.labels(kind)

    def observe(commands: int, elapsed_s: float) -> None:
        size.observe(commands)
        seconds.observe(elapsed_s)

    return observe


def _plan_keys(plan: AppendPlan) -> tuple[tuple[str, ...], ...]:
    """Two commits on one resource, or under one key, never share a batch."""
    keys: tuple[tuple[str, ...], ...] = (("resource", plan.new_state.resource),)
    if plan.idempotency.key is not None:
        keys += (("key", plan.idempotency.principal, plan.idempotency.key),)
    return keys


def _about_the_batch(error: Exception) -> bool:
    """Whether a failed batch's plans may succeed alone: yes for conflicts inside the batch (a key or
    stream taken concurrently, a deadlock), no when the database cannot be reached or timed out (or the
    guard already knows it cannot)."""
    return not (is_unreachable(error) or isinstance(error, Unavailable))


@value
class CommandContext:
    """Who asks, and how the request ties into a wider flow (stored in each event's metadata)."""

    principal: str = "anonymous"
    idempotency_key: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None
    saga_id: str | None = None


@value
class CommandResult:
    status_code: int
    body: str  # JSON, byte for byte what a replay of the same Idempotency-Key returns
    replayed: bool = False


class LockService:
    def __init__(
        self,
        pool: asyncpg.Pool,
        bounds: TtlBounds,
        *,
        conflict_retries: int = 16,
        acquire_timeout_s: float = 5.0,
        coalesce: bool = True,
        state_cache_size: int = 100_000,
        guard: DatabaseGuard | None = None,
        max_wait_ms: int = 30_000,
        wait_poll_s: float = 0.05,
    ) -> None:
        self._pool = pool
        self._bounds = bounds
        self._retries = conflict_retries
        self._acquire_timeout_s = acquire_timeout_s
        self.guard = guard or DatabaseGuard()
        # A size of 0 turns off deciding on remembered states (every command reads first).
        self._remembers = state_cache_size > 0
        self._states = StateCache(state_cache_size)
        self._new_streams = NewStreamGuess()
        self._appending = AppendsInFlight()
        self._max_wait_ms = max_wait_ms
        self._waiters = Waiters(pool, poll_s=wait_poll_s, acquire_timeout_s=acquire_timeout_s)
        # Batches of one, each sent at once, make a coalescer a plain pass-through (for measuring what
        # coalescing gains).
        batch = 256 if coalesce else 1
        in_flight = 4 if coalesce else pool.get_max_size()
        late_factor = LATE_FACTOR if coalesce else None
        self._loads: Coalescer[_LoadRequest, Snapshot] = Coalescer(
            self._load_one,
            self._load_many,
            max_in_flight=in_flight,
            max_batch=batch,
            late_factor=late_factor,
            retry_alone=_about_the_batch,
            on_batch=_batch_observer("load"),
        )
        self._commits: Coalescer[AppendPlan, Committed | None] = Coalescer(
            self._commit_one,
            self._commit_many,
            max_in_flight=in_flight,
            max_batch=batch,
            late_factor=late_factor,
            keys=_plan_keys,
            retry_alone=_about_the_batch,
            on_batch=_batch_observer("commit"),
        )

    @property
    def default_ttl_ms(self) -> int:
        """The lease length of an acquire that names none."""
        return self._bounds.default_ms

    @property
    def reads(self) -> int:
        """Commands that read their lock's state before deciding (the others decided on a remembered one)."""
        return self._loads.requests

    async def _load_one(self, request: _LoadRequest) -> Snapshot:
        async def work() -> Snapshot:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                return await lock_store.load(conn, *request)

        return await self.guard.run(work)

    async def _load_many(self, requests: list[_LoadRequest]) -> list[Snapshot]:
        async def work() -> list[Snapshot]:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                return await lock_store.load_many(conn, requests)

        return await self.guard.run(work)

    async def _commit_one(self, plan: AppendPlan) -> Committed | None:
        async def work() -> Committed | None:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                return await lock_store.commit(conn, plan)

        return await self.guard.run(work)

    async def _commit_many(self, plans: list[AppendPlan]) -> list[Committed | None]:
        async def work() -> list[Committed | None]:
            async with connection(self._pool, self._acquire_timeout_s) as conn:
                return await lock_store.commit_many(conn, plans)

        return await self.guard.run(work)

    def drain(self) -> None:
        """The server is shutting down: every waiting acquire answers 503 now, and none waits from now on."""
        self._waiters.drain()

    async def close(self) -> None:
        await self._waiters.close()

    async def execute(
        self,
        command: Command,
        ctx: CommandContext,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> CommandResult:
        """Run ``command`` to a decision that is committed, rejected (DomainError) or replayed.

        An acquire with ``wait_ms`` that finds the lock held waits for it to come free (at most
        ``max_wait_ms``; ``service/waiters.py``) before it is refused. ``abandoned`` says whether the caller
        has gone, so a waiting acquire takes no lock for nobody.
        """
        if isinstance(command, Acquire) and command.wait_ms > 0 and self._max_wait_ms > 0:
            wait_s = min(command.wait_ms, self._max_wait_ms) / 1000
            return await self._waiters.acquire(
                command.resource, lambda: self._execute(command, ctx), wait_s, abandoned
            )
        return await self._execute(command, ctx)

    async def _execute(self, command: Command, ctx: CommandContext) -> CommandResult:
        self._refuse_while_stalled()
        name, fields = _describe(command)
        idempotency = Idempotency(
            ctx.principal, ctx.idempotency_key, fingerprint(name, command.resource, fields)
        )
        metadata = _metadata(name, ctx)
        if self._appending.busy(command.resource):
            await self._appending.settled(command.resource)
        result = await self._execute_unread(command, idempotency, metadata)
        if result is not None:
            return result
        for attempt in range(self._retries + 1):
            if attempt > 0:  # the first read follows the check above or an answer from the database
                self._refuse_while_stalled()
            _READS.inc()
            snapshot = await self._loads.submit((command.resource, ctx.principal, ctx.idempotency_key))
            self._states.put(snapshot.state)
            if snapshot.stored is not None:
                stored = replay(snapshot.stored, idempotency.fingerprint)
                return CommandResult(stored.status_code, stored.body, replayed=True)
            events = decide(snapshot.state, command, snapshot.db_now, self._bounds)
            plan = append_plan(command, snapshot.state, events, metadata, idempotency)
            if plan is None:
                status_code, response = _response(command, events)
                return CommandResult(status_code, json.dumps(response, separators=(",", ":")))
            try:
                committed = await self._commit(plan)
            except asyncpg.UniqueViolationError:
                # A concurrent request with the same key (or a stream created under us) won: the next
                # load sees its outcome.
                continue
            if committed is not None:
                return CommandResult(plan.status_code, committed.response)
        raise Unavailable(f"{command.resource} is too contended to decide now; retry", retry_after_s=1)

    async def _execute_unread(
        self, command: Command, idempotency: Idempotency, metadata: dict[str, Any]
    ) -> CommandResult | None:
        """Decide on the remembered state and append at once (one round trip instead of two), or return
        None when the state must be read first.

        Only decisions that no clock but the database's can overturn are taken this way: an acquire of a
        lock last seen free (or never seen, while that guess pays: ``NewStreamGuess``), and a renew or
        release of a lease last seen held, which the append itself refuses once the lease has lapsed by
        the database's clock. A refusal is never answered from memory: the read may find this very
        request's stored outcome under its Idempotency-Key, or a newer state.
        """
        if not self._remembers:
            return None
        state = self._states.get(command.resource)
        guessed_new = state is None
        if state is None:
            if not isinstance(command, Acquire) or not self._new_streams.should_guess():
                return None
            state = initial_state(command.resource)
        elif not (
            (isinstance(command, Acquire) and state.status == "free")
            or (isinstance(command, Renew | Release) and state.status == "held")
        ):
            return None
        try:
            events = decide(state, command, datetime.now(UTC), self._bounds)
        except DomainError:
            return None
        plan = append_plan(command, state, events, metadata, idempotency)
        if plan is None:
            return None
        try:
            committed = await self._commit(plan)
        except asyncpg.UniqueViolationError:
            committed = None  # the Idempotency-Key is taken: the read finds its outcome
        if guessed_new:
            self._new_streams.record(committed is not None)
        if committed is None:
            _STALE_MEMORY.inc()
            self._states.forget(command.resource)
            return None
        _APPENDED_FROM_MEMORY.inc()
        return CommandResult(plan.status_code, committed.response)

    def _refuse_while_stalled(self) -> None:
        """Checked before a command queues for the database, not only around each round trip: while the
        database is stalled the coalescers' batches are stuck, and a new request would wait behind them
        instead of reaching the guard."""
        if self.guard.stalled_for() > 0:
            raise Unavailable(STALLED, retry_after_s=1)

    async def _commit(self, plan: AppendPlan) -> Committed | None:
        """Append ``plan`` and remember the state it led to (with the deadline as the database stamped it)."""
        resource = plan.new_state.resource
        self._appending.begin(resource)
        try:
            committed = await self._commits.submit(plan)
            if committed is not None:
                self._states.put(plan.new_state.with_deadline(committed.expires_at))
                if plan.new_state.status == "free":
                    self._waiters.freed(resource)
        finally:
            self._appending.end(resource)
        return committed


def append_plan(
    command: Command,
    state: LockState,
    events: list[Event],
    metadata: dict[str, Any],
    idempotency: Idempotency,
) -> AppendPlan | None:
    """The append that carries out a decision; None when the decision changes nothing."""
    if not events:
        return None
    status_code, response = _response(command, events)
    # Renew, release and a force-release of a live lease stand only if the lease is still live when
    # appended; otherwise decide again (it lapsed: lease_expired, or LOCK_EXPIRED).
    ends_live_lease = isinstance(command, Renew | Release) or isinstance(events[-1], LockForceReleased)
    return AppendPlan(
        expected_version=state.version,
        events=events,
        new_state=fold(state, events),
        require_live=ends_live_lease,
        status_code=status_code,
        response=response,
        metadata=metadata,
        idempotency=idempotency,
    )


def _describe(command: Command) -> tuple[str, dict[str, Any]]:
    if isinstance(command, Acquire):
        # Not wait_ms: how long a request may wait is not what it asks for, and a retry of an acquire
        # that timed out waiting sends what is left of its wait under the same Idempotency-Key.
        return "acquire", {"owner": command.owner, "ttl_ms": command.ttl_ms}
    if isinstance(command, Renew):
        return "renew", {
            "owner": command.owner,
            "fencing_token": command.fencing_token,
            "ttl_ms": command.ttl_ms,
        }
    if isinstance(command, Release):
        return "release", {"owner": command.owner, "fencing_token": command.fencing_token}
    if isinstance(command, ForceRelease):
        return "force-release", {"reason": command.reason}
    assert isinstance(command, Expire)
    return "expire", {}


def _response(command: Command, events: list[Event]) -> tuple[int, dict[str, Any]]:
    """The response body before the statement stamps ``expires_at`` into granting responses."""
    resource = command.resource
    if isinstance(command, Acquire | Renew):
        last = events[-1]
        body = {
            "resource": resource,
            "owner": last.owner,
            "fencing_token": last.fencing_token,
            "ttl_ms": getattr(last, "ttl_ms", None),
        }
        return (201 if isinstance(command, Acquire) else 200), body
    if isinstance(command, Release):
        last = events[-1]
        return 200, {
            "resource": resource,
            "owner": last.owner,
            "fencing_token": last.fencing_token,
            "released": True,
        }
    if not events:
        return 200, {"resource": resource, "released": False}
    last = events[-1]
    body = {
        "resource": resource,
        "released": True,
        "owner": last.owner,
        "fencing_token": last.fencing_token,
        "event": last.type,
    }
    if isinstance(last, LockForceReleased):
        body["reason"] = last.reason
    return 200, body


def _metadata(command: str, ctx: CommandContext) -> dict[str, Any]:
    metadata: dict[str, Any] = {"command": command, "actor": ctx.principal}
    for key in ("idempotency_key", "correlation_id", "causation_id", "saga_id"):
        value = getattr(ctx, key)
        if value is not None:
            metadata[key] = value
    return metadata
