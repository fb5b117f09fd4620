"""The waiting procedure of service/waiters.py against an in-memory lock, over generated schedules of
holders and waiters: a lock never sits free while someone in line waits for it, nobody is refused before
their wait ran out, nobody who has gone is granted, and the lines are gone when the waiters are.

No database: the follower is set to look once an hour, so only ``freed`` (a release through this
process) wakes a waiter, which is what these properties are about. The follower and the real decision
are covered on PostgreSQL in tests/storage/test_waiting_acquire.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain.errors import LockHeld
from service.fakes.database import MemoryDatabase
from service.fakes.notifier import MemoryNotifier
from service.waiters import Waiters

RESOURCE = "zone:A3"
# Scheduling on a loaded two-core machine: how long a free lock may wait for the next in line to run.
HANDOFF_SLACK_S = 0.1


@dataclass
class FakeLock:
    """One lock with the refusal the decider gives, and a timeline of when it was free while awaited."""

    waiters: Waiters
    holder: str | None = None
    attempts: int = 0
    grants: list[tuple[str, float]] = field(default_factory=list)
    idle_while_awaited: list[float] = field(default_factory=list)
    _freed_at: float | None = None

    def attempt(self, who: str) -> str:
        self.attempts += 1
        if self.holder is not None:
            raise LockHeld(RESOURCE, self.holder, datetime.now(UTC), len(self.grants))
        now = time.monotonic()
        if self._freed_at is not None:
            self.idle_while_awaited.append(now - self._freed_at)
            self._freed_at = None
        self.holder = who
        self.grants.append((who, now))
        return who

    def release(self, who: str) -> None:
        assert self.holder == who
        self.holder = None
        if self.waiters.waiting:
            self._freed_at = time.monotonic()
        self.waiters.freed(RESOURCE)


@dataclass(frozen=True)
class Agent:
    arrive_ms: int
    wait_ms: int
    hold_ms: int
    leaves_after_ms: int | None  # closes its connection this long after arriving, if at all


agents = st.lists(
    st.builds(
        Agent,
        arrive_ms=st.integers(0, 40),
        wait_ms=st.integers(1, 400),
        hold_ms=st.integers(0, 15),
        leaves_after_ms=st.none() | st.integers(0, 60),
    ),
    min_size=1,
    max_size=8,
)


async def _run(schedule: list[Agent]) -> tuple[FakeLock, dict[str, str], Waiters]:
    waiters = Waiters(MemoryNotifier(MemoryDatabase()), poll_s=3600)
    lock = FakeLock(waiters)
    outcomes: dict[str, str] = {}

    async def agent(name: str, spec: Agent) -> None:
        await asyncio.sleep(spec.arrive_ms / 1000)
        arrived = time.monotonic()
        leaves_at = None if spec.leaves_after_ms is None else arrived + spec.leaves_after_ms / 1000
        attempts = 0
        present_when_asked: bool | None = None

        async def abandoned() -> bool:
            nonlocal present_when_asked
            present_when_asked = leaves_at is None or time.monotonic() < leaves_at
            return not present_when_asked

        async def attempt(_ticket: int | None) -> str:
            nonlocal attempts, present_when_asked
            attempts += 1
            if attempts > 1:  # every attempt after the first is preceded by asking, and only if present
                assert present_when_asked is True, name
                present_when_asked = None
            return lock.attempt(name)

        try:
            await waiters.acquire(RESOURCE, name, attempt, spec.wait_ms / 1000, abandoned)
        except LockHeld:
            waited = time.monotonic() - arrived
            gone = present_when_asked is False
            # Refused only once the wait ran out, or because the caller had gone.
            assert gone or waited >= spec.wait_ms / 1000, (name, waited)
            outcomes[name] = "gone" if gone else "refused"
            return
        outcomes[name] = "granted"
        await asyncio.sleep(spec.hold_ms / 1000)
        lock.release(name)

    await asyncio.wait_for(
        asyncio.gather(*(agent(f"a{i}", spec) for i, spec in enumerate(schedule))), timeout=30
    )
    await waiters.close()
    return lock, outcomes, waiters


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(agents)
def test_a_free_lock_goes_at_once_to_the_next_in_line(schedule: list[Agent]) -> None:
    lock, outcomes, waiters = asyncio.run(_run(schedule))
    assert len(outcomes) == len(schedule)  # every agent got an answer
    assert sorted(who for who, _ in lock.grants) == sorted(w for w, o in outcomes.items() if o == "granted")
    assert all(idle < HANDOFF_SLACK_S for idle in lock.idle_while_awaited), lock.idle_while_awaited
    # Nobody polls: each agent tries on arrival, when its turn comes and when its wait runs out, and a
    # release wakes one agent.
    assert lock.attempts <= 3 * len(schedule) + len(lock.grants)
    assert lock.holder is None
    assert waiters.waiting == 0
    assert not waiters._lines  # no line outlives its waiters
