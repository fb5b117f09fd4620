"""The simulator's invariant ledger: which simulated agent believes it holds what, checked at every grant.

Two rules, judged from what the agents observe alone: per resource, the fencing tokens of successive
grants strictly increase; and no two grants of one resource are believed at the same time. A belief
lasts from the grant until the agent sends its release or hand-off, its lease is lost (the SDK's
watchdog fired, or the lease's local deadline, ``monotonic() before sending + ttl - margin``, has
passed) or the agent crashes. The SDK sets that deadline no later than the server's, so a crashed
agent's lease that the reaper expired and another agent then took is no violation, while a server that
granted a lock before the previous holder's lease could have ended is.

Reservations and hand-offs add three rules: a reservation grants every resource asked for or none
(never a partial set), a hand-off gives the receiver a token above the giver's (and the receiver
accepts that very token), and the giver's token is refused once it handed the lease on.

Shared locks (``shared_granted``) are kept apart from the mutex of the same name (their stream,
``shared/<resource>``, as the server keeps them) and relax the second rule by mode: grants of one shared
lock may be believed together only if none is exclusive (never a reader with a writer) and, under a
limit, no more than the limit at once (never more than N on a semaphore's N permits). Tokens still
strictly increase, across both modes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["EXCLUSIVE", "Held", "Ledger"]

_EXAMPLES = 10  # violations described in full; the rest are counted
_SHARED = "shared/"  # a shared lock's key: its stream, never a mutex's (a resource has no "/")
EXCLUSIVE = "exclusive"


class _Flag(Protocol):
    def is_set(self) -> bool: ...


class Held(Protocol):
    """What the ledger reads of a lease: ``lockledger.AsyncLease`` has both."""

    @property
    def deadline(self) -> float: ...  # the local deadline, on the monotonic clock

    @property
    def lost(self) -> _Flag: ...


@dataclass
class _Belief:
    holder: str
    token: int
    lease: Held
    exclusive: bool = True
    ended: bool = False

    def live(self, now: float) -> bool:
        return not self.ended and not self.lease.lost.is_set() and self.lease.deadline > now


@dataclass
class _Resource:
    last_token: int = 0
    holders: dict[int, str] = field(default_factory=dict)  # every grant seen: token -> holder
    beliefs: list[_Belief] = field(default_factory=list)
    handed: dict[str, int] = field(default_factory=dict)  # hand-offs awaiting acceptance: receiver -> token


class Ledger:
    """Shared by every agent of one simulation (one event loop, so no locking)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._resources: dict[str, _Resource] = {}
        self.checked = 0  # grants checked against both rules
        self.reservations_checked = 0  # reservations checked for all or nothing
        self.handoffs_checked = 0  # hand-offs checked for a higher token
        self.shared_checked = 0  # shared-lock grants checked, among ``checked``
        self.most_permits = 0  # the most grants seen at once on one lock with a limit (a semaphore)
        self.most_readers = 0  # the most shared grants seen at once on one lock without a limit
        self.violations = 0
        self.examples: list[str] = []

    def granted(self, resource: str, token: int, holder: str, lease: Held) -> None:
        """``holder`` is about to act on ``resource`` under ``token``. A grant it already reported is not
        checked again, and neither is one whose lease is already over: nobody believes in it."""
        self._check(resource, _Belief(holder, token, lease))

    def shared_granted(
        self, resource: str, token: int, holder: str, lease: Held, mode: str, limit: int | None
    ) -> None:
        """``holder`` is about to act on the shared lock ``resource`` under a grant in ``mode`` (``shared``
        or ``exclusive``) of a lock limited to ``limit`` grants (None: no limit)."""
        belief = _Belief(holder, token, lease, exclusive=mode == EXCLUSIVE)
        if not self._check(_SHARED + resource, belief, limit):
            return
        self.shared_checked += 1
        together = len(self._resources[_SHARED + resource].beliefs)
        if limit is not None:
            self.most_permits = max(self.most_permits, together)
        elif not belief.exclusive:
            self.most_readers = max(self.most_readers, together)

    def _check(self, resource: str, belief: _Belief, limit: int | None = None) -> bool:
        """Check ``belief`` against the grants believed before it; whether it was checked (not a repeat,
        nor already over)."""
        now = self._clock()
        state = self._resources.setdefault(resource, _Resource())
        holder, token = belief.holder, belief.token
        seen = state.holders.get(token)
        if seen == holder or not belief.live(now):
            return False
        self.checked += 1
        if seen is not None:
            self._violated(f"{resource}: token {token} granted to {seen} and again to {holder}")
        elif token <= state.last_token:
            self._violated(f"{resource}: token {token} to {holder} after token {state.last_token}")
        state.beliefs = [b for b in state.beliefs if b.live(now)]
        for other in state.beliefs:
            if belief.exclusive or other.exclusive:
                self._violated(
                    f"{resource}: {holder} granted token {token} while {other.holder} still holds token"
                    f" {other.token} for {other.lease.deadline - now:.3f} s"
                )
        if limit is not None and len(state.beliefs) >= limit:
            self._violated(
                f"{resource}: {holder} granted token {token} as grant {len(state.beliefs) + 1} of {limit}"
            )
        state.holders[token] = holder
        state.last_token = max(state.last_token, token)
        state.beliefs.append(belief)
        return True

    def reserved(
        self, resources: Collection[str], tokens: Mapping[str, int], holder: str, lease: Held
    ) -> None:
        """``holder`` was granted a reservation of ``resources``, with ``tokens`` (resource -> token) under
        one ``lease``: all or nothing, so exactly the resources asked for have a token; then each lease is
        checked as a grant."""
        self.reservations_checked += 1
        if set(tokens) != set(resources):
            self._violated(
                f"reservation by {holder}: asked for {sorted(resources)}, granted {sorted(tokens)}"
            )
        for resource, token in tokens.items():
            self.granted(resource, token, holder, lease)

    def handed_off(self, resource: str, giver_token: int, token: int, receiver: str) -> None:
        """The giver's lease ``giver_token`` on ``resource`` passed to ``receiver`` with ``token``, which
        must be above the giver's. The giver stopped acting on it when it sent the hand-off
        (``released``); the receiver's acceptance (``accepted``) is checked as a grant of ``token``."""
        self.handoffs_checked += 1
        state = self._resources.setdefault(resource, _Resource())
        if token <= giver_token:
            self._violated(
                f"{resource}: handed to {receiver} with token {token}, not above the giver's {giver_token}"
            )
        state.handed[receiver] = token

    def giver_token_answered(self, resource: str, token: int, refused: bool) -> None:
        """The giver used its token ``token`` again after handing ``resource`` off: it must be refused."""
        if not refused:
            self._violated(f"{resource}: the giver's token {token} was accepted after its hand-off")

    def accepted(self, resource: str, token: int, holder: str, lease: Held) -> None:
        """``holder`` accepted the hand-off of ``resource`` and holds it with ``token``: the token the
        hand-off gave it, and a grant like any other."""
        state = self._resources.setdefault(resource, _Resource())
        expected = state.handed.pop(holder, None)
        if expected is not None and token != expected:
            self._violated(f"{resource}: {holder} accepted token {token}, handed token {expected}")
        self.granted(resource, token, holder, lease)

    def released(self, resource: str, token: int, shared: bool = False) -> None:
        """The holder is sending the release (or hand-off): from now on it no longer acts on the resource
        (``shared``: on the shared lock of that name)."""
        state = self._resources.get(_SHARED + resource if shared else resource)
        for belief in state.beliefs if state is not None else []:
            if belief.token == token:
                belief.ended = True

    def crashed(self, holder: str) -> None:
        """The holder is gone: what it held is abandoned, for the server to expire."""
        for state in self._resources.values():
            for belief in state.beliefs:
                if belief.holder == holder:
                    belief.ended = True

    def _violated(self, description: str) -> None:
        self.violations += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(description)
