"""What this process last knew of each lock, so a command can often skip reading it first.

A command is two round trips: read the stream head, then append with the version it read. But the
append already refuses to write unless the head is still at the expected version (``lock_store``), so
the read only saves work when the state has changed since this process last saw it. For a lock this
process itself acquired a moment ago (the release that follows every acquire, the heartbeats in between)
it has not, and the command can decide on the remembered state and append at once: one round trip.

Nothing here is trusted: a stale entry only costs the append that the version check refuses, and the
caller then reads and decides as usual. Which decisions may be taken without reading is the caller's
rule (``LockService``): only those whose outcome cannot depend on a clock other than the database's.

A stream this process has never seen is most often new (a pallet arriving in the warehouse), so an
acquire on it may be appended as the stream's first event straight away; ``NewStreamGuess`` keeps
count of how often that guess holds and stops guessing while it mostly fails (after a restart, say,
when every stream exists but none is remembered).
"""

from __future__ import annotations

from domain.state import LockState


class StateCache:
    """The latest committed state of up to ``capacity`` locks, the least recently used dropped first."""

    __slots__ = ("_capacity", "_states")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._states: dict[str, LockState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def get(self, resource: str) -> LockState | None:
        return self._states.get(resource)

    def put(self, state: LockState) -> None:
        if self._capacity <= 0:
            return
        states = self._states
        # Re-inserted at the end: a dict keeps insertion order, so its first key is the least recent.
        states.pop(state.resource, None)
        states[state.resource] = state
        if len(states) > self._capacity:
            del states[next(iter(states))]

    def forget(self, resource: str) -> None:
        self._states.pop(resource, None)


class NewStreamGuess:
    """Whether to take an unknown stream for a new one: yes while at least half of recent guesses held.

    The rate is an exponential moving average over roughly the last ``1 / weight`` guesses. While it is
    low, one unknown stream in ``probe_every`` is still guessed so the rate can recover.
    """

    __slots__ = ("_probe_every", "_unguessed", "_weight", "rate")

    def __init__(self, weight: float = 0.05, probe_every: int = 32) -> None:
        self._weight = weight
        self._probe_every = probe_every
        self._unguessed = 0  # unknown streams read first while the rate was low
        self.rate = 1.0

    def should_guess(self) -> bool:
        if self.rate >= 0.5:
            return True
        self._unguessed += 1
        return self._unguessed % self._probe_every == 0

    def record(self, held: bool) -> None:
        self.rate += self._weight * ((1.0 if held else 0.0) - self.rate)
