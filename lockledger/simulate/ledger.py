"""The simulator's invariant ledger: which simulated agent believes it holds what, checked at every grant.

Two rules, judged from what the agents observe alone: per resource, the fencing tokens of successive
grants strictly increase; and no two grants of one resource are believed at the same time. A belief
lasts from the grant until the agent sends its release, its lease is lost (the SDK's watchdog fired, or
the lease's local deadline, ``monotonic() before sending + ttl - margin``, has passed) or the agent
crashes. The SDK sets that deadline no later than the server's, so a crashed agent's lease that the
reaper expired and another agent then took is no violation, while a server that granted a lock before
the previous holder's lease could have ended is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Held", "Ledger"]

_EXAMPLES = 10  # violations described in full; the rest are counted


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
    ended: bool = False

    def live(self, now: float) -> bool:
        return not self.ended and not self.lease.lost.is_set() and self.lease.deadline > now


@dataclass
class _Resource:
    last_token: int = 0
    holders: dict[int, str] = field(default_factory=dict)  # every grant seen: token -> holder
    beliefs: list[_Belief] = field(default_factory=list)


class Ledger:
    """Shared by every agent of one simulation (one event loop, so no locking)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._resources: dict[str, _Resource] = {}
        self.checked = 0  # grants checked against both rules
        self.violations = 0
        self.examples: list[str] = []

    def granted(self, resource: str, token: int, holder: str, lease: Held) -> None:
        """``holder`` is about to act on ``resource`` under ``token``. A grant it already reported is not
        checked again, and neither is one whose lease is already over: nobody believes in it."""
        now = self._clock()
        state = self._resources.setdefault(resource, _Resource())
        seen = state.holders.get(token)
        if seen == holder:
            return
        belief = _Belief(holder, token, lease)
        if not belief.live(now):
            return
        self.checked += 1
        if seen is not None:
            self._violated(f"{resource}: token {token} granted to {seen} and again to {holder}")
        elif token <= state.last_token:
            self._violated(f"{resource}: token {token} to {holder} after token {state.last_token}")
        state.beliefs = [b for b in state.beliefs if b.live(now)]
        for other in state.beliefs:
            self._violated(
                f"{resource}: {holder} granted token {token} while {other.holder} still holds token"
                f" {other.token} for {other.lease.deadline - now:.3f} s"
            )
        state.holders[token] = holder
        state.last_token = max(state.last_token, token)
        state.beliefs.append(belief)

    def released(self, resource: str, token: int) -> None:
        """The holder is sending the release: from now on it no longer acts on the resource."""
        state = self._resources.get(resource)
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
