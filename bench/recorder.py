"""What the agents of one cell observed: latencies per command, cycles, conflicts, errors and grants.

Latencies and counts are kept only while the measurement window is open (``active``); errors and grants are
kept for the whole cell (warm-up and drain included), because a correctness problem counts whenever it
happens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.safety import Grant

COMMANDS = ("acquire", "renew", "release", "conflict")
MAX_ERROR_SAMPLES = 5


@dataclass
class Recorder:
    record_grants: bool = False
    active: bool = False
    cycles: int = 0
    conflicts: int = 0
    requests: int = 0
    errors: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in COMMANDS})
    error_kinds: Counter[str] = field(default_factory=Counter)
    grants: list[Grant] = field(default_factory=list)

    def command(self, name: str, seconds: float) -> None:
        """A command that succeeded (2xx), or an acquire refused because the lock is held (``conflict``)."""
        if self.active:
            self.requests += 1
            self.latencies[name].append(seconds)
            if name == "conflict":
                self.conflicts += 1

    def cycle(self) -> None:
        if self.active:
            self.cycles += 1

    def error(self, command: str, error: BaseException) -> None:
        self.errors += 1
        if self.active:
            self.requests += 1
        text = str(error) or type(error).__name__
        kind = f"{command}: {type(error).__name__}: {text[:160]}"
        if kind in self.error_kinds or len(self.error_kinds) < MAX_ERROR_SAMPLES:
            self.error_kinds[kind] += 1

    def grant(self, resource: str, token: object, acquired_at: float, release_sent_at: float) -> None:
        if self.record_grants:
            self.grants.append(Grant(resource, token, acquired_at, release_sent_at))
