"""The shared-lock use case: load the shared lock, decide (``domain/shared_lock.py``), commit through the
``SharedLockStore`` port, and on a lost race load and decide again (bounded).

As for a mutex: Idempotency-Keys are scoped to the principal and fingerprinted by the command as decided;
an acquire with ``wait_ms`` that is refused waits in the lock's fair queue (the mutex's ``Waiters`` and
``lock_queue``, keyed by the stream id ``shared/<resource>``) and is tried again when a grant ends; a
commit that ends a grant while acquires queue wakes them on every server. A queued grant that leaves
others queued wakes them too: readers waiting together are granted together.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import structlog
from prometheus_client import Counter

from domain.errors import DomainError
from domain.resource import TtlBounds
from domain.shared_lock import (
    EXCLUSIVE,
    AcquireShared,
    ExpireShared,
    ReleaseShared,
    RenewShared,
    SharedAcquired,
    SharedCommand,
    SharedEvent,
    SharedLockState,
    SharedRenewed,
    check_queue,
    decide,
    shared_event_payload,
    stream_id,
)
from domain.timestamps import format_timestamp
from domain.value import value
from projections.shared_locks import PlannedGrant, SharedPlan
from service.database_guard import DatabaseGuard
from service.errors import Unavailable
from service.idempotency import fingerprint, replay
from service.lock_service import CommandContext, command_metadata
from service.ports import CommitConflict, SharedLockStore, StoredOutcome
from service.waiters import Waiters

log = structlog.get_logger("lockledger.reaper")

SHARED_COMMANDS_TOTAL = Counter(
    "lockledger_shared_lock_commands_total",
    "Shared-lock commands executed by this process, by mode (of an acquire) and outcome: done, replayed,"
    " or the refusal's code",
    ["command", "mode", "outcome"],
)


@value
class SharedResult:
    """``outcome``: the answer's fields, JSON-ready (the deadline as text); ``changed``: events appended."""

    outcome: dict[str, Any]
    replayed: bool = False
    changed: bool = False


class SharedLockService:
    def __init__(
        self,
        store: SharedLockStore,
        bounds: TtlBounds,
        waiters: Waiters,
        guard: DatabaseGuard,
        *,
        conflict_retries: int = 16,
        max_wait_ms: int = 30_000,
    ) -> None:
        self.store = store
        self._bounds = bounds
        self._waiters = waiters
        self._guard = guard
        self._retries = conflict_retries
        self._max_wait_ms = max_wait_ms

    @property
    def default_ttl_ms(self) -> int:
        return self._bounds.default_ms

    async def execute(
        self,
        command: SharedCommand,
        ctx: CommandContext,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> SharedResult:
        """Run ``command`` to a decision that is committed, rejected (``DomainError``) or replayed; an
        acquire with ``wait_ms`` refused for want of a place waits in the queue (``max_wait_ms`` at most).
        Each is counted once by its outcome (``lockledger_shared_lock_commands_total``)."""
        name = _describe(command)[0]
        mode = command.mode if isinstance(command, AcquireShared) else ""
        try:
            if isinstance(command, AcquireShared) and command.wait_ms > 0 and self._max_wait_ms > 0:
                result = await self._waiters.acquire(
                    stream_id(command.resource),
                    command.owner,
                    lambda ticket: self._execute(command, ctx, ticket),
                    min(command.wait_ms, self._max_wait_ms) / 1000,
                    abandoned,
                    exclusive=command.mode == EXCLUSIVE,
                )
            else:
                result = await self._execute(command, ctx)
        except DomainError as error:
            SHARED_COMMANDS_TOTAL.labels(name, mode, error.code).inc()
            raise
        SHARED_COMMANDS_TOTAL.labels(name, mode, "replayed" if result.replayed else "done").inc()
        return result

    async def _execute(
        self, command: SharedCommand, ctx: CommandContext, ticket: int | None = None
    ) -> SharedResult:
        name, fields = _describe(command)
        stream = stream_id(command.resource)
        digest = fingerprint(name, stream, fields)
        metadata = command_metadata(name, ctx)
        if ticket is not None:  # the audit trail shows a grant's place in the queue
            metadata["queue_ticket"] = ticket
        for _ in range(self._retries + 1):
            loaded = await self._guard.run(
                partial(self.store.load, command.resource, ctx.principal, ctx.idempotency_key)
            )
            if loaded.stored is not None:
                stored = replay(StoredOutcome(*loaded.stored), digest)
                return SharedResult(json.loads(stored), replayed=True)
            events = decide(loaded.state, command, loaded.db_now, self._bounds)
            if isinstance(command, AcquireShared):
                check_queue(command, loaded.first, loaded.first_exclusive, ticket, loaded.db_now)
            if not events:
                return SharedResult({"resource": command.resource, "expired": []})
            plan = plan_of(command, loaded.state, events, metadata, ctx, digest, ticket)
            try:
                committed = await self._guard.run(partial(self.store.commit, plan))
            except CommitConflict:
                continue  # the key was taken by a concurrent request: the next load finds its answer
            if committed is None:
                continue  # the lock moved on, the grant lapsed or a waiter came first: decide again
            if plan.ended:
                self._waiters.freed(stream)
            if committed.queued and (plan.ended or ticket is not None):
                await self._waiters.announce(stream)
            outcome = dict(plan.response)
            if committed.expires_at is not None:
                outcome["expires_at"] = format_timestamp(committed.expires_at)
            return SharedResult(outcome, changed=True)
        raise Unavailable(f"{command.resource} is too contended to decide now; retry", retry_after_s=1)


def plan_of(
    command: SharedCommand,
    state: SharedLockState,
    events: list[SharedEvent],
    metadata: dict[str, Any],
    ctx: CommandContext,
    digest: bytes,
    ticket: int | None,
) -> SharedPlan:
    """The append that carries out ``events``, and the answer it stores (a grant's deadline: the commit's)."""
    last = events[-1]
    grant: PlannedGrant | None = None
    if isinstance(last, SharedAcquired):
        grant = PlannedGrant(last.owner, last.mode, last.limit, last.fencing_token, last.ttl_ms)
    elif isinstance(last, SharedRenewed):
        held = next(g for g in state.grants if g.fencing_token == last.fencing_token)
        grant = PlannedGrant(held.owner, held.mode, held.limit, held.fencing_token, last.ttl_ms)
    ended = tuple(e.fencing_token for e in events if not isinstance(e, SharedAcquired | SharedRenewed))
    return SharedPlan(
        resource=command.resource,
        expected_version=state.version,
        events=[(event.type, shared_event_payload(event)) for event in events],
        metadata=metadata,
        principal=ctx.principal,
        key=ctx.idempotency_key,
        fingerprint=digest,
        response=_answer(command, state, events, grant),
        grant=grant,
        acquires=isinstance(last, SharedAcquired),
        ended=ended,
        live_token=command.fencing_token if isinstance(command, RenewShared | ReleaseShared) else None,
        ticket=ticket if isinstance(last, SharedAcquired) else None,
        waits_for_every_ticket=not (
            isinstance(command, AcquireShared) and command.mode != EXCLUSIVE and command.limit is None
        ),
    )


def _answer(
    command: SharedCommand, state: SharedLockState, events: list[SharedEvent], grant: PlannedGrant | None
) -> dict[str, Any]:
    if grant is not None:
        return {
            "resource": command.resource, "owner": grant.owner, "mode": grant.mode, "limit": grant.limit,
            "fencing_token": grant.fencing_token, "ttl_ms": grant.ttl_ms,
        }  # fmt: skip
    if isinstance(command, ReleaseShared):
        held = next(g for g in state.grants if g.fencing_token == command.fencing_token)
        return {
            "resource": command.resource, "owner": held.owner, "mode": held.mode,
            "fencing_token": held.fencing_token, "released": True,
        }  # fmt: skip
    return {"resource": command.resource, "expired": [event.fencing_token for event in events]}


def _describe(command: SharedCommand) -> tuple[str, dict[str, Any]]:
    """The command's name and fields, for its fingerprint and its events' metadata (not ``wait_ms``: how
    long a request may wait is not what it asks for)."""
    if isinstance(command, AcquireShared):
        return "shared-acquire", {
            "owner": command.owner, "mode": command.mode, "limit": command.limit, "ttl_ms": command.ttl_ms,
        }  # fmt: skip
    if isinstance(command, RenewShared):
        return "shared-renew", {
            "owner": command.owner, "fencing_token": command.fencing_token, "ttl_ms": command.ttl_ms,
        }  # fmt: skip
    if isinstance(command, ReleaseShared):
        return "shared-release", {"owner": command.owner, "fencing_token": command.fencing_token}
    assert isinstance(command, ExpireShared)
    return "shared-expire", {}


async def expire_shared(service: SharedLockService, batch: int) -> int:
    """The reaper's pass: expire the lapsed grants of up to ``batch`` grants' worth of shared locks; the
    number of grants expired. A lock renewed or released meanwhile is decided again as it is then."""
    expired = 0
    for resource in await service.store.due(batch):
        try:
            result = await service.execute(ExpireShared(resource), CommandContext(principal="reaper"))
        except Unavailable as error:  # the database went away, or the lock is too contended: next pass
            log.warning("shared lock expiry not decided; next pass", resource=resource, error=str(error))
            return expired
        expired += len(result.outcome["expired"])
    return expired
