"""The command use case: load the lock (or take it from memory), decide, commit, and on a lost race load
and decide again (bounded).

``LockService`` sees ports only (``service/ports.py``): one ``LockStore`` and, through ``Waiters``, the
``Notifier``; remembered states, coalesced round trips, in-flight ordering and the database guard are
adapters around the store (``service/store_adapters.py``), each switched on or off by settings. The
server wires the PostgreSQL adapters (``service/composition.py``); tests may wire the fakes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter

from domain.commands import Accept, Acquire, Command, Decline, Expire, ForceRelease, HandOff, Release, Renew
from domain.decider import decide, fold
from domain.errors import DomainError
from domain.events import Event, LockForceReleased
from domain.queue import check_turn
from domain.resource import TtlBounds
from domain.state import LockState, Status
from domain.value import value
from service.database_guard import DatabaseGuard
from service.errors import Unavailable
from service.idempotency import fingerprint, replay
from service.outcomes import CommandResult, answer_fields, outcome_of
from service.ports import AppendPlan, CommitConflict, Idempotency, LoadRequest, LockStore
from service.waiters import Waiters

_READS = Counter("lockledger_command_reads_total", "Commands that read their lock's state before deciding")

COMMANDS_TOTAL = Counter(
    "lockledger_commands_total",
    "Commands executed by this process, by outcome: what they did (granted, renewed, released,"
    " force_released, expired), the refusal's code (lock_held, not_holder, lease_expired, ...), or"
    " replayed (an Idempotency-Key's stored answer)",
    ["command", "outcome"],
)
# Each command's label, and the outcome it counts when it did what it was asked.
_COMMAND_NAMES: dict[type[Command], tuple[str, str]] = {
    Acquire: ("acquire", "granted"),
    Renew: ("renew", "renewed"),
    Release: ("release", "released"),
    ForceRelease: ("force_release", "force_released"),
    Expire: ("expire", "expired"),
    HandOff: ("handoff", "handed_off"),
    Accept: ("accept", "accepted"),
    Decline: ("decline", "declined"),
}
_REFUSALS = ("lock_held", "not_holder", "lease_expired", "validation_error", "domain_error")


class _CommandCounts:
    """The counter's children bound once per (command, outcome): the hot path only looks one up."""

    def __init__(self) -> None:
        self._children = {
            (kind, outcome): COMMANDS_TOTAL.labels(name, outcome)
            for kind, (name, done) in _COMMAND_NAMES.items()
            for outcome in (done, "replayed", *_REFUSALS)
        }

    def done(self, command: Command, result: CommandResult) -> None:
        kind = type(command)
        self._children[kind, "replayed" if result.replayed else _COMMAND_NAMES[kind][1]].inc()

    def refused(self, command: Command, error: DomainError) -> None:
        child = self._children.get((type(command), error.code))
        if child is None:  # a refusal code added later: bound on first use
            child = self._children[type(command), error.code] = COMMANDS_TOTAL.labels(
                _COMMAND_NAMES[type(command)][0], error.code
            )
        child.inc()


_COUNTS = _CommandCounts()


@value
class CommandContext:
    """Who asks, and how the request ties into a wider flow (stored in each event's metadata)."""

    principal: str = "anonymous"
    idempotency_key: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None
    saga_id: str | None = None
    saga_step: str | None = None


class LockService:
    def __init__(
        self,
        store: LockStore,
        bounds: TtlBounds,
        waiters: Waiters,
        guard: DatabaseGuard,
        *,
        conflict_retries: int = 16,
        max_wait_ms: int = 30_000,
    ) -> None:
        self.store = store
        self.guard = guard  # also the readiness probe's and the authenticator's
        self._bounds = bounds
        self._waiters = waiters
        self._retries = conflict_retries
        self._max_wait_ms = max_wait_ms
        self.reads = 0  # commands that read their lock's state (the others decided on a remembered one)

    @property
    def default_ttl_ms(self) -> int:
        """The lease length of an acquire that names none."""
        return self._bounds.default_ms

    @property
    def waiters(self) -> Waiters:
        """The waiting acquires of this process (a waiting reservation watches the same locks)."""
        return self._waiters

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
        has gone, so a waiting acquire takes no lock for nobody. Each command is counted once by its
        outcome (``lockledger_commands_total``); one the database could not serve is not counted.
        """
        try:
            if isinstance(command, Acquire) and command.wait_ms > 0 and self._max_wait_ms > 0:
                wait_s = min(command.wait_ms, self._max_wait_ms) / 1000
                result = await self._waiters.acquire(
                    command.resource,
                    command.owner,
                    lambda ticket: self._execute(command, ctx, ticket),
                    wait_s,
                    abandoned,
                )
            else:
                result = await self._execute(command, ctx)
        except DomainError as error:
            _COUNTS.refused(command, error)
            raise
        _COUNTS.done(command, result)
        return result

    async def _execute(
        self, command: Command, ctx: CommandContext, ticket: int | None = None
    ) -> CommandResult:
        """Load, decide, commit; on a lost race, load and decide again (at most ``conflict_retries``).
        An acquire is decided with the lock's queue too (``domain/queue.py``): it may take a free lock
        only if no live ticket precedes ``ticket``, its place in the queue (None: it has none)."""
        name, fields = _describe(command)
        idempotency = Idempotency(
            ctx.principal, ctx.idempotency_key, fingerprint(name, command.resource, fields)
        )
        metadata = command_metadata(name, ctx)
        if ticket is not None:  # the audit trail shows a grant's place in the queue
            metadata["queue_ticket"] = ticket
        request = LoadRequest(command.resource, ctx.principal, ctx.idempotency_key, _remembered_if(command))
        reads = 0
        while reads <= self._retries:
            [snapshot] = await self.store.load([request])
            request = request.read_first()  # a second try never trusts memory
            if not snapshot.remembered:
                reads += 1
                self.reads += 1
                _READS.inc()
            if snapshot.stored is not None:
                stored = replay(snapshot.stored, idempotency.fingerprint)
                return CommandResult(outcome_of(command, json.loads(stored)), replayed=True)
            try:
                if isinstance(command, Acquire):
                    check_turn(snapshot.state, snapshot.queue_head, ticket, snapshot.db_now)
                events = decide(snapshot.state, command, snapshot.db_now, self._bounds)
            except DomainError:
                if snapshot.remembered:  # a refusal is never answered from memory: read, decide again
                    continue
                raise
            plan = append_plan(
                command, snapshot.state, events, metadata, idempotency, snapshot.remembered, ticket
            )
            if plan is None:
                if snapshot.remembered:
                    continue
                return CommandResult(outcome_of(command, answer_fields(command, events)))
            try:
                [committed] = await self.store.commit([plan])
            except CommitConflict:
                continue  # the next load sees the winner's outcome
            if committed is not None:
                if plan.new_state.status == "free":
                    self._waiters.freed(command.resource)
                    if committed.queued:
                        await self._waiters.announce(command.resource)
                return CommandResult(outcome_of(command, plan.response, committed.expires_at))
        raise Unavailable(f"{command.resource} is too contended to decide now; retry", retry_after_s=1)


def _remembered_if(command: Command) -> Status | None:
    """Which remembered state a command may be decided on without reading: only decisions that no clock
    but the store's can overturn. An acquire of a lock last seen free (or never seen); a renew or release
    of a lease last seen held (renewed, released, handed off or taken up), which the commit refuses once
    the lease has lapsed by the store's clock."""
    if isinstance(command, Acquire):
        return "free"
    if isinstance(command, Renew | Release | HandOff | Accept | Decline):
        return "held"
    return None


def append_plan(
    command: Command,
    state: LockState,
    events: list[Event],
    metadata: dict[str, Any],
    idempotency: Idempotency,
    remembered: bool = False,
    ticket: int | None = None,
) -> AppendPlan | None:
    """The append that carries out a decision; None when the decision changes nothing."""
    if not events:
        return None
    # Renew, release, a hand-off, its acceptance or refusal, and a force-release of a live lease stand
    # only if the lease is still live when appended; otherwise decide again (it lapsed: lease_expired, or
    # LOCK_EXPIRED).
    ends_live_lease = isinstance(command, Renew | Release | HandOff | Accept | Decline) or isinstance(
        events[-1], LockForceReleased
    )
    return AppendPlan(
        expected_version=state.version,
        events=events,
        new_state=fold(state, events),
        require_live=ends_live_lease,
        response=answer_fields(command, events),
        metadata=metadata,
        idempotency=idempotency,
        remembered=remembered,
        ticket=ticket,
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
    if isinstance(command, HandOff):
        return "handoff", {
            "owner": command.owner,
            "fencing_token": command.fencing_token,
            "to": command.to,
            "accept_within_ms": command.accept_within_ms,
        }
    if isinstance(command, Accept):
        return "accept", {"owner": command.owner, "ttl_ms": command.ttl_ms}
    if isinstance(command, Decline):
        return "decline", {"owner": command.owner}
    assert isinstance(command, Expire)
    return "expire", {}


def command_metadata(command: str, ctx: CommandContext) -> dict[str, Any]:
    metadata: dict[str, Any] = {"command": command, "actor": ctx.principal}
    for key in ("idempotency_key", "correlation_id", "causation_id", "saga_id", "saga_step"):
        value = getattr(ctx, key)
        if value is not None:
            metadata[key] = value
    return metadata
