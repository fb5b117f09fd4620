"""A Lock aggregate and its Application on the ``eventsourcing`` library (v9), for the baseline.

The library's idiomatic shape: command methods on the aggregate decide and trigger events (``@event``),
the Application loads the aggregate from its repository, calls the method and saves; a concurrent save of
the same aggregate fails with ``IntegrityError`` (the version is taken) and the command is retried. The
aggregate id is derived from the resource with uuid5. Deadlines use the application's clock (the library
has no database-clock hook), which is fine for a throughput baseline.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import NAMESPACE_URL, UUID, uuid5

from eventsourcing.application import AggregateNotFoundError, Application
from eventsourcing.domain import Aggregate, event
from eventsourcing.persistence import IntegrityError

RESOURCE_NAMESPACE = uuid5(NAMESPACE_URL, "urn:lockledger:bench:lock")
MAX_ATTEMPTS = 16


class LockHeldError(Exception):
    pass


class NotHolderError(Exception):
    pass


class Lock(Aggregate):
    @event("Created")
    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.owner: str | None = None
        self.token = 0
        self.expires_at = 0.0

    @staticmethod
    def create_id(resource: str) -> UUID:
        return uuid5(RESOURCE_NAMESPACE, resource)

    def acquire(self, owner: str, ttl_ms: int, now: float) -> None:
        if self.owner is not None and self.expires_at > now:
            raise LockHeldError(self.resource)
        self._acquired(owner, now + ttl_ms / 1000)

    def renew(self, owner: str, token: int, ttl_ms: int, now: float) -> None:
        self._check_holder(owner, token, now)
        self._renewed(now + ttl_ms / 1000)

    def release(self, owner: str, token: int, now: float) -> None:
        self._check_holder(owner, token, now)
        self._released()

    def _check_holder(self, owner: str, token: int, now: float) -> None:
        if self.owner != owner or self.token != token or self.expires_at <= now:
            raise NotHolderError(self.resource)

    @event("Acquired")
    def _acquired(self, owner: str, expires_at: float) -> None:
        self.owner = owner
        self.token += 1
        self.expires_at = expires_at

    @event("Renewed")
    def _renewed(self, expires_at: float) -> None:
        self.expires_at = expires_at

    @event("Released")
    def _released(self) -> None:
        self.owner = None
        self.expires_at = 0.0


class LockApp(Application[UUID]):
    """Commands in, events out; each public method is one command and one save."""

    name = "BenchLocks"

    def _load(self, resource: str) -> Lock:
        try:
            lock: Lock = self.repository.get(Lock.create_id(resource))
        except AggregateNotFoundError:
            lock = Lock(resource)
        return lock

    def acquire(self, resource: str, owner: str, ttl_ms: int) -> int | None:
        """The new fencing token, or None when the lock is held."""
        for _ in range(MAX_ATTEMPTS):
            lock = self._load(resource)
            try:
                lock.acquire(owner, ttl_ms, time.time())
            except LockHeldError:
                return None
            try:
                self.save(lock)
            except IntegrityError:
                continue  # another command saved this aggregate first: decide again
            return lock.token
        raise RuntimeError(f"acquire {resource}: lost {MAX_ATTEMPTS} races in a row")

    def renew(self, resource: str, owner: str, token: int, ttl_ms: int) -> None:
        self._command(resource, lambda lock: lock.renew(owner, token, ttl_ms, time.time()))

    def release(self, resource: str, owner: str, token: int) -> None:
        self._command(resource, lambda lock: lock.release(owner, token, time.time()))

    def _command(self, resource: str, decide: Any) -> None:
        for _ in range(MAX_ATTEMPTS):
            lock = self._load(resource)
            decide(lock)
            try:
                self.save(lock)
            except IntegrityError:
                continue
            return
        raise RuntimeError(f"{resource}: lost {MAX_ATTEMPTS} races in a row")
