"""The reservation use case: load every resource, decide the set, commit it all or nothing, and on a lost
race load and decide again (bounded); a reserve with ``wait_ms`` waits holding nothing.

A reservation's leases are ordinary leases (``domain/reservation.py``), so the loads go through the lock
store with its adapters (in-flight ordering, coalescing, the database guard), always read, never taken
from memory. The commit goes to the ``AtomicLockStore`` port: every plan in one transaction, heads locked
in resource order. The first plan carries the request's Idempotency-Key and the whole set's answer, so a
retry replays the set; every plan's events carry the reservation id in their metadata.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from prometheus_client import Counter

from domain.commands import Acquire, Command, Release, Renew
from domain.errors import DomainError, LockHeld
from domain.events import DEADLINE_FIELD, Event, LockAcquired, LockRenewed
from domain.queue import check_turn
from domain.reservation import (
    ReleaseReservation,
    RenewReservation,
    ReservationCommand,
    ReservationHeld,
    Reserve,
    ReservedLease,
    decide_reservation,
    resources_of,
    tokens_of,
    validate_reservation,
)
from domain.resource import TtlBounds
from domain.state import LockState
from domain.value import value
from service.errors import Unavailable
from service.idempotency import fingerprint, replay
from service.lock_service import CommandContext, append_plan, command_metadata
from service.ports import (
    AppendPlan,
    AtomicLockStore,
    CommitConflict,
    Idempotency,
    LoadRequest,
    LockStore,
    Snapshot,
)
from service.waiters import Waiters

RESERVATIONS_TOTAL = Counter(
    "lockledger_reservation_commands_total",
    "Reservation commands executed by this process, by outcome: done, replayed, or the refusal's code",
    ["command", "outcome"],
)
_ID_NAMESPACE = uuid.UUID("5d0a4a8e-2f7c-4b55-9a43-7c1b0f1e6a21")  # reservation ids made from keys
_NAMES: dict[type[ReservationCommand], str] = {
    Reserve: "reserve",
    RenewReservation: "reserve-renew",
    ReleaseReservation: "reserve-release",
}


@value
class Reservation:
    """A reserve or a renewal of the set: its leases (in the order asked) and their one deadline."""

    reservation_id: str
    owner: str
    leases: tuple[ReservedLease, ...]
    expires_at: datetime
    ttl_ms: int


@value
class ReservationReleased:
    """A release of the set, or of the part of it named."""

    reservation_id: str
    owner: str
    leases: tuple[ReservedLease, ...]
    released: bool = True


@value
class ReservationResult:
    outcome: Reservation | ReservationReleased
    replayed: bool = False


class ReservationService:
    def __init__(
        self,
        store: LockStore,
        atomic: AtomicLockStore,
        bounds: TtlBounds,
        waiters: Waiters,
        *,
        conflict_retries: int = 16,
        max_wait_ms: int = 30_000,
    ) -> None:
        self._store = store
        self._atomic = atomic
        self._bounds = bounds
        self._waiters = waiters
        self._retries = conflict_retries
        self._max_wait_ms = max_wait_ms

    @property
    def default_ttl_ms(self) -> int:
        return self._bounds.default_ms

    @staticmethod
    def new_id(ctx: CommandContext) -> str:
        """A reservation id for a reserve that names none: derived from the Idempotency-Key when there is
        one, so a retry names the same reservation (and matches its fingerprint); random otherwise."""
        if ctx.idempotency_key is None:
            return str(uuid.uuid4())
        return str(uuid.uuid5(_ID_NAMESPACE, f"{ctx.principal}\n{ctx.idempotency_key}"))

    async def execute(
        self,
        command: ReservationCommand,
        ctx: CommandContext,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> ReservationResult:
        """Run ``command`` to a decision committed (the whole set), rejected (DomainError) or replayed.
        A reserve with ``wait_ms`` whose resources are held waits for them (at most ``max_wait_ms``)
        without holding any; ``abandoned`` says whether the caller has gone."""
        name = _NAMES[type(command)]
        try:
            if isinstance(command, Reserve) and command.wait_ms > 0 and self._max_wait_ms > 0:
                wait_s = min(command.wait_ms, self._max_wait_ms) / 1000
                result = await self._wait(command, ctx, wait_s, abandoned)
            else:
                result = await self._execute(command, ctx)
        except DomainError as error:
            RESERVATIONS_TOTAL.labels(name, error.code).inc()
            raise
        RESERVATIONS_TOTAL.labels(name, "replayed" if result.replayed else "done").inc()
        return result

    async def _wait(
        self,
        command: Reserve,
        ctx: CommandContext,
        wait_s: float,
        abandoned: Callable[[], Awaitable[bool]] | None,
    ) -> ReservationResult:
        """Try; while refused ``LockHeld``, try again each time any resource may have come free, and once
        more when the wait runs out with no wake since the last refusal (the answer is the state then).
        Nothing is held between tries, so waiting reservations can never deadlock one another."""
        try:
            return await self._execute(command, ctx)
        except LockHeld as held:
            refusal = held
        if self._waiters.draining:
            raise _shutting_down()
        give_up_at = time.monotonic() + wait_s
        async with self._waiters.watch(resources_of(command)) as woken:
            while True:
                left = give_up_at - time.monotonic()
                was_woken = woken.is_set() or (left > 0 and await _wait_for(woken, left))
                if self._waiters.draining:
                    raise _shutting_down()
                if abandoned is not None and await abandoned():
                    raise refusal
                woken.clear()
                try:
                    return await self._execute(command, ctx)
                except LockHeld as held:
                    if not was_woken or time.monotonic() >= give_up_at:
                        raise
                    refusal = held

    async def _execute(self, command: ReservationCommand, ctx: CommandContext) -> ReservationResult:
        validate_reservation(command)  # before anything is loaded for it
        resources = resources_of(command)
        idempotency = Idempotency(ctx.principal, ctx.idempotency_key, _fingerprint(command))
        metadata = {**command_metadata(_NAMES[type(command)], ctx), "reservation_id": command.reservation_id}
        requests = [LoadRequest(resource, ctx.principal, ctx.idempotency_key) for resource in resources]
        for _ in range(self._retries + 1):
            snapshots = await self._store.load(requests)
            stored = next((s.stored for s in snapshots if s.stored is not None), None)
            if stored is not None:
                answer = json.loads(replay(stored, idempotency.fingerprint))
                return ReservationResult(_outcome(answer), replayed=True)
            # Loads may share round trips with others: judge by the latest clock read, still before the
            # commit's (a lease lapsed then has lapsed at the commit; one live is checked again there).
            now = max(snapshot.db_now for snapshot in snapshots)
            states = {
                resource: snapshot.state for resource, snapshot in zip(resources, snapshots, strict=True)
            }
            if isinstance(command, Reserve):
                _check_turns(snapshots, now)
            decided = decide_reservation(states, command, now, self._bounds)
            answer = _answer(command, decided)
            plans = [
                _plan(command, states[resource], events, metadata, idempotency, answer, first=number == 0)
                for number, (resource, events) in enumerate(decided.items())
            ]
            try:
                committed = await self._atomic.commit_all(plans)
            except CommitConflict:
                continue  # the next load sees the winner (its key's answer, or its leases)
            if committed is None:
                continue  # a stream moved on, or a lease lapsed, since the load: decide again
            for plan, done in zip(plans, committed, strict=True):
                if plan.new_state.status == "free":
                    self._waiters.freed(plan.new_state.resource)
                    if done.queued:
                        await self._waiters.announce(plan.new_state.resource)
            deadline = committed[0].expires_at
            return ReservationResult(_outcome(answer, deadline))
        raise Unavailable("these resources are too contended to reserve now; retry", retry_after_s=1)


async def _wait_for(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` was set within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


def _single(command: ReservationCommand, resource: str) -> Command:
    """The lock command ``command`` is on one of its resources (whose rules its plan follows)."""
    if isinstance(command, Reserve):
        return Acquire(resource, command.owner, command.ttl_ms)
    token = tokens_of(command)[resource]
    if isinstance(command, RenewReservation):
        return Renew(resource, command.owner, token, command.ttl_ms)
    return Release(resource, command.owner, token)


def _plan(
    command: ReservationCommand,
    state: LockState,
    events: list[Event],
    metadata: dict[str, Any],
    idempotency: Idempotency,
    answer: dict[str, Any],
    *,
    first: bool,
) -> AppendPlan:
    """One resource's append. The first plan keeps the key and the set's answer (its deadline, the same
    for every lease, is added by the commit); the others keep no key of their own."""
    plan = append_plan(_single(command, state.resource), state, events, metadata, idempotency)
    assert plan is not None  # every reservation decision appends on every resource
    if first:
        return dataclasses.replace(plan, response=answer)
    return dataclasses.replace(
        plan, idempotency=Idempotency(idempotency.principal, None, idempotency.fingerprint), response={}
    )


def _answer(command: ReservationCommand, decided: dict[str, list[Event]]) -> dict[str, Any]:
    """The set's answer as stored under its key: leases in the order the request named them."""
    order = command.resources if isinstance(command, Reserve) else list(tokens_of(command))
    last = {resource: events[-1] for resource, events in decided.items()}
    leases = [{"resource": resource, "fencing_token": last[resource].fencing_token} for resource in order]
    answer: dict[str, Any] = {
        "reservation_id": command.reservation_id,
        "owner": command.owner,
        "leases": leases,
    }
    grant = last[order[0]]
    if isinstance(grant, LockAcquired | LockRenewed):
        answer["ttl_ms"] = grant.ttl_ms
    else:
        answer["released"] = True
    return answer


def _outcome(answer: dict[str, Any], expires_at: datetime | None = None) -> Reservation | ReservationReleased:
    leases = tuple(ReservedLease(lease["resource"], lease["fencing_token"]) for lease in answer["leases"])
    if answer.get("released"):
        return ReservationReleased(answer["reservation_id"], answer["owner"], leases)
    deadline = expires_at or datetime.fromisoformat(answer[DEADLINE_FIELD])
    return Reservation(answer["reservation_id"], answer["owner"], leases, deadline, answer["ttl_ms"])


def _fingerprint(command: ReservationCommand) -> bytes:
    """The request as decided, not ``wait_ms`` (a retry sends what is left of its wait). A reservation id
    the server made up is the same on a retry under the same key (``new_id``)."""
    name = _NAMES[type(command)]
    if isinstance(command, Reserve):
        fields: dict[str, Any] = {
            "owner": command.owner,
            "ttl_ms": command.ttl_ms,
            "resources": list(command.resources),
        }
        return fingerprint(name, command.reservation_id, fields)
    fields = {
        "owner": command.owner,
        "leases": [[lease.resource, lease.fencing_token] for lease in command.leases],
    }
    if isinstance(command, RenewReservation):
        fields["ttl_ms"] = command.ttl_ms
    return fingerprint(name, command.reservation_id, fields)


def _shutting_down() -> Unavailable:
    return Unavailable("this server is shutting down; retry", retry_after_s=1)


def _check_turns(snapshots: list[Snapshot], now: datetime) -> None:
    """A reservation holds no ticket: it takes no free lock that acquires queue for (``domain/queue.py``);
    ``ReservationHeld`` names each such lock."""
    queued: list[LockHeld] = []
    for snapshot in snapshots:
        try:
            check_turn(snapshot.state, snapshot.queue_head, None, now)
        except LockHeld as held:
            queued.append(held)
    if queued:
        raise ReservationHeld(tuple(queued))
