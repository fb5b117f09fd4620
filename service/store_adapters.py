"""The command path's performance machinery, as adapters around a ``LockStore``.

Each adapter is a ``LockStore`` wrapping another, so the use case (``LockService``) sees one store and
each piece can be switched off alone (``Adapters``, from settings). Outermost first, as ``build_store``
stacks them:

- ``InFlightOrdering``: a load waits for this process's commits in flight on its resource
  (``service/appends_in_flight.py``), so it decides on the state they leave.
- ``Remembering``: answers a load from the state this process last saw, when the request says that
  state will do (``service/state_cache.py``); remembers what it loads and commits.
- ``StallCheck``: refuses at once while the database is stalled, before a request queues behind the
  stuck batches.
- ``Coalescing``: concurrent loads, and commits on distinct resources and keys, share one round trip
  (``service/coalescer.py``).
- ``Guarded``: every round trip through the circuit breaker (``service/database_guard.py``).
- ``AfterOutage``: before the first round trip after the database was unreachable, the live leases are
  extended by the outage (``service/outage.py``). Not a speed-up: a safety rule, never switched off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence

from prometheus_client import Counter, Histogram

from domain.state import initial_state
from domain.value import value
from service.appends_in_flight import AppendsInFlight
from service.coalescer import LATE_FACTOR, Coalescer
from service.database_guard import DatabaseGuard, is_unreachable
from service.errors import Unavailable
from service.outage import OutageWatch
from service.ports import AppendPlan, Clock, Committed, LoadRequest, LockStore, Snapshot
from service.state_cache import NewStreamGuess, StateCache

# Whether remembering pays, per process: commands appended straight from memory, and those whose memory
# proved stale (and were read after all).
_FROM_MEMORY = Counter(
    "lockledger_commands_from_memory_total",
    "Commands decided on a remembered lock state: appended at once, or refused as stale and read again",
    ["outcome"],
)
_APPENDED_FROM_MEMORY = _FROM_MEMORY.labels("appended")
_STALE_MEMORY = _FROM_MEMORY.labels("stale")

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


@value
class Adapters:
    """Which adapters wrap the store; each may be switched off alone (to measure what it gains)."""

    order_in_flight: bool = True
    state_cache_size: int = 100_000  # 0: no remembered states, every command reads first
    coalesce: bool = True
    database_guard: bool = True


def build_store(
    store: LockStore,
    guard: DatabaseGuard,
    adapters: Adapters,
    clock: Clock,
    outage_watch: OutageWatch | None = None,
) -> LockStore:
    """``store`` wrapped in the adapters switched on, outermost first as listed above; ``clock`` stands
    in for the store's when a state is remembered rather than read."""
    if outage_watch is not None:
        store = AfterOutage(store, outage_watch)
    if adapters.database_guard:
        store = Guarded(store, guard)
    if adapters.coalesce:
        store = Coalescing(store)
    if adapters.database_guard:
        store = StallCheck(store, guard)
    if adapters.state_cache_size > 0:
        store = Remembering(store, adapters.state_cache_size, clock)
    if adapters.order_in_flight:
        store = InFlightOrdering(store)
    return store


class InFlightOrdering:
    """A load waits until no commit of this process is in flight on its resource."""

    def __init__(self, inner: LockStore) -> None:
        self.inner = inner
        self._appending = AppendsInFlight()

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        for request in requests:
            if self._appending.busy(request.resource):
                await self._appending.settled(request.resource)
        return await self.inner.load(requests)

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        resources = [plan.new_state.resource for plan in plans]
        for resource in resources:
            self._appending.begin(resource)
        try:
            return await self.inner.commit(plans)
        finally:
            for resource in resources:
                self._appending.end(resource)


class Remembering:
    """Answers loads from the states this process last saw, where the request allows it.

    Only a request's ``remembered_if`` status will do (the use case's rule: decisions that no clock but
    the store's can overturn), and a stream never seen is taken for new when that status is "free"
    while that guess pays (``NewStreamGuess``). Nothing here is trusted: a stale state only costs the
    commit that the version check refuses, after which the state is forgotten and read.
    """

    def __init__(self, inner: LockStore, capacity: int, clock: Clock) -> None:
        self.inner = inner
        self._clock = clock  # the store's clock as near as this process can read it
        self.states = StateCache(capacity)
        self.new_streams = NewStreamGuess()
        self._guessed: set[str] = set()  # streams answered as new, until their commit tells

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        if len(requests) == 1:  # the use case's every call: no lists to merge
            answer = self._recall(requests[0])
            if answer is None:
                [answer] = await self.inner.load(requests)
                self.states.put(answer.state)
            return [answer]
        answers = [self._recall(request) for request in requests]
        unanswered = [request for request, answer in zip(requests, answers, strict=True) if answer is None]
        if not unanswered:
            return [answer for answer in answers if answer is not None]
        loaded = iter(await self.inner.load(unanswered))
        snapshots = []
        for answer in answers:
            if answer is None:
                answer = next(loaded)
                self.states.put(answer.state)
            snapshots.append(answer)
        return snapshots

    def _recall(self, request: LoadRequest) -> Snapshot | None:
        if request.remembered_if is None:
            self._guessed.discard(request.resource)
            return None
        state = self.states.get(request.resource)
        if state is None:
            if request.remembered_if != "free" or not self.new_streams.should_guess():
                return None
            self._guessed.add(request.resource)
            state = initial_state(request.resource)
        elif state.status != request.remembered_if:
            return None
        return Snapshot(db_now=self._clock.now(), state=state, stored=None, remembered=True)

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        try:
            results = await self.inner.commit(plans)
        except Exception:
            for plan in plans:
                self._settle(plan, None)
            raise
        for plan, committed in zip(plans, results, strict=True):
            self._settle(plan, committed)
        return results

    def _settle(self, plan: AppendPlan, committed: Committed | None) -> None:
        resource = plan.new_state.resource
        if resource in self._guessed:
            self._guessed.discard(resource)
            self.new_streams.record(committed is not None)
        if committed is None:
            self.states.forget(resource)
            if plan.remembered:
                _STALE_MEMORY.inc()
            return
        self.states.put(plan.new_state.with_deadline(committed.expires_at))
        if plan.remembered:
            _APPENDED_FROM_MEMORY.inc()


class StallCheck:
    """Refuses before a request queues for the database while a round trip has stalled: the coalescer's
    batches are stuck then, and a new request would wait behind them instead of reaching the guard."""

    def __init__(self, inner: LockStore, guard: DatabaseGuard) -> None:
        self.inner = inner
        self._guard = guard

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        self._guard.refuse_if_stalled()
        return await self.inner.load(requests)

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        self._guard.refuse_if_stalled()
        return await self.inner.commit(plans)


class Guarded:
    """Every round trip through the database guard (circuit breaker and stall watchdog)."""

    def __init__(self, inner: LockStore, guard: DatabaseGuard) -> None:
        self.inner = inner
        self._guard = guard

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        return await self._guard.run(lambda: self.inner.load(requests))

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        return await self._guard.run(lambda: self.inner.commit(plans))


def _plan_keys(plan: AppendPlan) -> tuple[Hashable, ...]:
    """Two commits on one resource, or under one key, never share a batch."""
    keys: tuple[Hashable, ...] = (("resource", plan.new_state.resource),)
    if plan.idempotency.key is not None:
        keys += (("key", plan.idempotency.principal, plan.idempotency.key),)
    return keys


def _about_the_batch(error: Exception) -> bool:
    """Whether a failed batch's plans may succeed alone: yes for conflicts inside the batch (a key or
    stream taken concurrently, a deadlock), no when the database cannot be reached or timed out (or the
    guard already knows it cannot)."""
    return not (is_unreachable(error) or isinstance(error, Unavailable))


def _batch_observer(kind: str) -> Callable[[int, float], None]:
    size = _BATCH_SIZE.labels(kind)
    seconds = _BATCH_SECONDS.labels(kind)

    def observe(commands: int, elapsed_s: float) -> None:
        size.observe(commands)
        seconds.observe(elapsed_s)

    return observe


class Coalescing:
    """Concurrent calls share round trips: one batch of each kind out at a time while batches come back on
    time (``service/coalescer.py``); a lone request goes out at once, as a batch of one."""

    def __init__(self, inner: LockStore) -> None:
        self.inner = inner
        self._loads: Coalescer[LoadRequest, Snapshot] = Coalescer(
            self._load_one,
            inner.load,
            late_factor=LATE_FACTOR,
            retry_alone=_about_the_batch,
            on_batch=_batch_observer("load"),
        )
        self._commits: Coalescer[AppendPlan, Committed | None] = Coalescer(
            self._commit_one,
            inner.commit,
            late_factor=LATE_FACTOR,
            keys=_plan_keys,
            retry_alone=_about_the_batch,
            on_batch=_batch_observer("commit"),
        )

    async def _load_one(self, request: LoadRequest) -> Snapshot:
        [snapshot] = await self.inner.load([request])
        return snapshot

    async def _commit_one(self, plan: AppendPlan) -> Committed | None:
        [committed] = await self.inner.commit([plan])
        return committed

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        if len(requests) == 1:
            return [await self._loads.submit(requests[0])]
        return list(await asyncio.gather(*(self._loads.submit(request) for request in requests)))

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        if len(plans) == 1:
            return [await self._commits.submit(plans[0])]
        return list(await asyncio.gather(*(self._commits.submit(plan) for plan in plans)))


class AfterOutage:
    """A round trip after the database was unreachable first extends the leases the outage would have
    lapsed, so this process never takes over or refuses a lease on a deadline nobody could renew."""

    def __init__(self, inner: LockStore, watch: OutageWatch) -> None:
        self.inner = inner
        self._watch = watch

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        await self._watch.resume_if_needed()
        try:
            return await self.inner.load(requests)
        except Exception as error:
            self._watch.saw_failure(error)
            raise

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        await self._watch.resume_if_needed()
        try:
            return await self.inner.commit(plans)
        except Exception as error:
            self._watch.saw_failure(error)
            raise
