"""The ports the use cases depend on, with the types that cross them.

The lock use case (``service/lock_service.py``), waiting acquires (``service/waiters.py``), sagas
(``service/saga_service.py``) and the reaper (``service/reaper.py``) see only these Protocols. Each has a
PostgreSQL adapter (the product) and an in-memory fake (tests, and a server without a database); one
contract suite runs every port against both (``tests/service/test_store_contract.py``), which is what
entitles the fakes to stand in for PostgreSQL in behaviour tests.

- ``LockStore``: load what a lock decision needs, commit a decision's plan (``service/store.py``).
- ``AtomicLockStore``: commit a reservation's plans all or nothing (``service/reservation_store.py``).
- ``SagaStore``: the same for one saga transition (``service/saga_store.py``).
- ``ReaperStore``: what a reaper pass does in the store: expire lapsed leases, find lapsed sagas, purge
  old Idempotency-Keys (``service/reaper_store.py``).
- ``Notifier``: which awaited locks may have come free, what wakes waiting reservations
  (``service/notifier.py``).
- ``Queue`` and ``Listener``: the fair queue of waiting acquires and its wakes (``service/queue_store.py``).
- ``Clock``: the instant decisions are serialized at. In PostgreSQL it is ``clock_timestamp()``, read
  inside the very statement that serializes the decision, so the PostgreSQL adapters take no clock object;
  the fakes serialize in this process and read a ``Clock`` (``service/clock.py``: a settable one in tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from domain.events import Event
from domain.queue import Ticket
from domain.saga import SagaEvent, SagaState
from domain.state import LockState, Status
from domain.value import value
from projections.saga_state import SagaRow  # the read model's row: the query side reads it too
from projections.shared_locks import SharedCommitted, SharedPlan, SharedSnapshot

# --- shared by the stores ---------------------------------------------------------------------------


@value
class StoredOutcome:
    """What an Idempotency-Key already produced."""

    fingerprint: bytes
    response: str  # the answer's fields, JSON (service/outcomes.py)


@value
class Idempotency:
    """The key a command came with (None: none), scoped to its principal, and the request's fingerprint."""

    principal: str
    key: str | None
    fingerprint: bytes


class CommitConflict(Exception):
    """A commit lost a race the version check does not catch: its Idempotency-Key was taken, or its new
    stream created, concurrently. It wrote nothing; the next load sees the winner."""


class Clock(Protocol):
    """The instant a decision is serialized at, as an in-process store reads it."""

    def now(self) -> datetime: ...


# --- the lock store ---------------------------------------------------------------------------------


@value
class LoadRequest:
    """What one command needs loaded. ``remembered_if``: a remembered state with that status will do (an
    adapter may answer from memory, ``service/store_adapters.py``); None: read the store."""

    resource: str
    principal: str
    key: str | None
    remembered_if: Status | None = None

    def read_first(self) -> LoadRequest:
        """This request, never answered from memory."""
        if self.remembered_if is None:
            return self
        return LoadRequest(self.resource, self.principal, self.key)


@value
class Snapshot:
    """A loaded lock: the store's clock at the read, the stream head, and the key's stored outcome."""

    db_now: datetime
    state: LockState
    stored: StoredOutcome | None
    remembered: bool = False  # answered from this process's memory, not read (service/store_adapters.py)
    queue_head: Ticket | None = None  # the first live ticket of the lock's queue (domain/queue.py)


@value
class AppendPlan:
    """A decision ready to be committed: the events, the state they lead to, and the response."""

    expected_version: int
    events: list[Event]
    new_state: LockState
    require_live: bool
    response: dict[str, Any]  # the answer's fields; a grant's deadline is added by the commit
    metadata: dict[str, Any]
    idempotency: Idempotency
    remembered: bool = False  # decided on a remembered state, not one just read
    ticket: int | None = None  # the waiting acquire's ticket: the grant stands only if none precedes it


@value
class Committed:
    expires_at: datetime | None  # the lease deadline as stored (a grant's is stamped by the commit)
    queued: bool = False  # the lock came free while acquires queue for it: wake them (a NOTIFY)


class LockStore(Protocol):
    """Where lock streams are kept. ``commit`` stands only if the stream is still at the expected version
    and, for a renew or release, the lease is still live by the store's clock at that instant; it stamps a
    grant's deadline from that clock and keeps the response under the Idempotency-Key. A store that keeps
    a queue of waiting acquires (PostgreSQL; the fakes keep none) also refuses a grant while a live ticket
    precedes the plan's own, removes a granted ticket, and says when a freed lock has tickets waiting."""

    async def load(self, requests: Sequence[LoadRequest]) -> list[Snapshot]:
        """For each request, in order: the stream head, the store's clock, any stored outcome of the key."""
        ...

    async def commit(self, plans: Sequence[AppendPlan]) -> list[Committed | None]:
        """Commit each plan (distinct resources and keys), in order; None for a plan whose stream moved on
        or whose lease lapsed (it wrote nothing). Raises ``CommitConflict`` having written nothing."""
        ...


class AtomicLockStore(Protocol):
    """Where a reservation's plans are committed: all of them in one transaction, or none."""

    async def commit_all(self, plans: Sequence[AppendPlan]) -> list[Committed] | None:
        """Commit every plan (distinct resources, their heads locked in resource order) by the rules of
        ``LockStore.commit``, in one transaction; None, having written nothing, when any plan's stream
        moved on or its lease lapsed. Raises ``CommitConflict`` having written nothing."""
        ...


# --- the saga store ---------------------------------------------------------------------------------


@value
class SagaSnapshot:
    """A loaded saga and what the request's Idempotency-Key already produced."""

    row: SagaRow
    stored: StoredOutcome | None


@value
class SagaPlan:
    """One saga transition ready to be committed."""

    expected_version: int
    events: list[SagaEvent]
    new_state: SagaState
    metadata: dict[str, Any]
    idempotency: Idempotency
    response: dict[str, Any]  # the stored view; the commit adds its instants


class StreamTaken(Exception):
    """The saga's stream id is already a lock's stream: the transition can never be appended."""


class SagaStore(Protocol):
    async def load(self, saga_id: str, principal: str, key: str | None) -> SagaSnapshot:
        """The saga's head (a never-started saga at version 0) and the key's stored outcome."""
        ...

    async def commit(self, plan: SagaPlan) -> datetime | None:
        """Append the plan's events and move the head, its lease deadline stamped from the store's clock;
        the instant of the append, or None when the head moved meanwhile (nothing written). Raises
        ``CommitConflict`` (the key taken concurrently) or ``StreamTaken``, having written nothing."""
        ...


# --- the shared locks' store ------------------------------------------------------------------------


class SharedLockStore(Protocol):
    """Shared locks and semaphores (``projections/shared_locks.py`` in PostgreSQL)."""

    async def load(self, resource: str, principal: str, key: str | None) -> SharedSnapshot:
        """The shared lock's state, the store's clock, the key's stored outcome, the queue's first tickets."""
        ...

    async def commit(self, plan: SharedPlan) -> SharedCommitted | None:
        """Append and project ``plan``, a grant's deadline stamped from the store's clock; None when the head
        moved, a renewed or released grant lapsed or a waiter has the prior claim (nothing written). Raises
        ``CommitConflict`` (the key taken concurrently), having written nothing."""
        ...

    async def due(self, limit: int) -> list[str]:
        """Shared locks with a grant past its deadline by the store's clock (the reaper's pass)."""
        ...


# --- the reaper's store -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Expiry:
    """A lease the reaper expired: its deadline and the instant of its ``LOCK_EXPIRED``."""

    resource: str
    fencing_token: int
    deadline: datetime
    expired_at: datetime

    @property
    def lateness_s(self) -> float:
        return (self.expired_at - self.deadline).total_seconds()


@value
class DueSaga:
    """An unfinished saga whose lease deadline had passed at ``now`` (the store's clock)."""

    saga_id: str
    now: datetime


class ReaperStore(Protocol):
    async def expire_due(self, batch_size: int, reaper_id: str, outage_after_ms: int | None) -> list[Expiry]:
        """Expire up to ``batch_size`` leases lapsed by the store's clock, never one a renew moved first;
        with ``outage_after_ms``, none while an outage may have just ended unextended."""
        ...

    async def due_sagas(self, limit: int) -> list[DueSaga]:
        """Up to ``limit`` unfinished sagas whose lease deadline has passed, soonest deadline first."""
        ...

    async def purge_keys(self, retention_s: int, batch: int) -> int:
        """Forget up to ``batch`` Idempotency-Keys older than ``retention_s``; how many were forgotten."""
        ...

    async def purge_tickets(self, batch: int) -> int:
        """Forget up to ``batch`` queue tickets past their deadline (their waiters never left); how many."""
        ...

    async def create_partitions(self, interval: str, ahead: int) -> int:
        """Create the log's partitions, one ``interval`` ("day" or "month") each, until ``ahead`` intervals
        past now are covered; how many were created."""
        ...


# --- the notifier -----------------------------------------------------------------------------------


class NotifierUnavailable(Exception):
    """The notifier could not look; the waiters ask again at the next look."""


class Notifier(Protocol):
    async def freed(self, resources: Sequence[str]) -> list[str]:
        """Which of ``resources`` are free now, or held past their deadline by the store's clock. Raises
        ``NotifierUnavailable`` when it cannot tell."""
        ...


# --- the fair queue ---------------------------------------------------------------------------------


class Queue(Protocol):
    """The queue of waiting acquires, kept where the grants are serialized (docs/decisions/0049)."""

    async def enter(self, resource: str, owner: str, wait_ms: int, exclusive: bool = True) -> int | None:
        """A ticket at the end of ``resource``'s queue (a mutex's resource, or a shared lock's stream id),
        live for ``wait_ms`` by the store's clock; None when there is nothing to wait for. ``exclusive``:
        the ticket waits for an exclusive grant (a shared lock's reader's does not). Raises
        ``NotifierUnavailable``."""
        ...

    async def leave(self, ticket: int) -> None:
        """Remove ``ticket`` (if still there) and wake the waiters behind it; never raises."""
        ...

    async def announce(self, resource: str) -> None:
        """Wake every server's waiters on ``resource`` (it came free); never raises."""
        ...


class Listener(Protocol):
    """What carries the queue's wakes to this server's waiters."""

    async def listening(self) -> None:
        """Return once wakes are delivered. Raises ``NotifierUnavailable``."""
        ...

    async def close(self) -> None: ...
