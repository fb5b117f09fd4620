"""A fleet on the fakes: agents in rounds of concurrent commands through two services (two processes'
worth of memories, coalescing and waiting) on one ``MemoryDatabase``, while the store's clock moves and a
reaper passes. Whatever hypothesis draws, the lock's safety holds: at most one live holder per lock, the
fencing tokens of grants strictly increasing in the log, and no acknowledged event missing from it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from domain.commands import Acquire, Command, Release, Renew
from domain.errors import DomainError
from domain.events import LockAcquired
from domain.resource import TtlBounds
from service.clock import SettableClock
from service.config import Settings
from service.fakes.database import MemoryDatabase
from service.lock_service import CommandContext, LockService
from service.outcomes import Granted, Released
from tests.in_memory import lock_service_in_memory, reaper_in_memory

BOUNDS = TtlBounds(min_ms=10, max_ms=600_000, default_ms=30_000)
RESOURCES = ("pallet:42", "zone:A3")
AGENTS = 4


@dataclass(frozen=True)
class Move:
    agent: int
    resource: int
    kind: str  # acquire, renew or release
    service: int
    wait: bool


@dataclass(frozen=True)
class Round:
    moves: list[Move]
    advance_ms: int
    reap: bool


moves = st.builds(
    Move,
    agent=st.integers(0, AGENTS - 1),
    resource=st.integers(0, len(RESOURCES) - 1),
    kind=st.sampled_from(["acquire", "renew", "release"]),
    service=st.integers(0, 1),
    wait=st.booleans(),
)
rounds = st.builds(
    Round,
    moves=st.lists(moves, min_size=1, max_size=6),
    advance_ms=st.sampled_from([0, 400, 1_000]),
    reap=st.booleans(),
)


@dataclass
class Held:
    token: int
    expires_at: datetime


async def _play(story: list[Round]) -> None:
    clock = SettableClock()
    database = MemoryDatabase(clock)
    services = [lock_service_in_memory(database, BOUNDS, wait_poll_s=0.001) for _ in range(2)]
    reaper = reaper_in_memory(database, Settings(reaper_enabled=False))
    held: dict[tuple[int, str], Held] = {}  # what each agent was told it holds
    acknowledged: list[tuple[str, str, int]] = []  # (resource, event type, token) of every success

    async def play(move: Move) -> None:
        resource, owner = RESOURCES[move.resource], f"agv-{move.agent}"
        mine = held.get((move.agent, resource))
        command: Command
        if move.kind == "acquire":
            command = Acquire(resource, owner, 1_000, wait_ms=20 if move.wait else 0)
        elif mine is None:
            return
        elif move.kind == "renew":
            command = Renew(resource, owner, mine.token, 1_000)
        else:
            command = Release(resource, owner, mine.token)
        service: LockService = services[move.service]
        try:
            result = await service.execute(command, CommandContext())
        except DomainError:
            return
        outcome = result.outcome
        if isinstance(outcome, Granted):
            held[(move.agent, resource)] = Held(outcome.fencing_token, outcome.expires_at)
            kind = "LOCK_ACQUIRED" if move.kind == "acquire" else "LOCK_RENEWED"
            acknowledged.append((resource, kind, outcome.fencing_token))
        elif isinstance(outcome, Released):
            held.pop((move.agent, resource), None)
            acknowledged.append((resource, "LOCK_RELEASED", outcome.fencing_token))

    try:
        for round_ in story:
            await asyncio.gather(*(play(move) for move in round_.moves))
            clock.advance(round_.advance_ms / 1000)
            if round_.reap:
                await reaper.run_once()
            now = clock.now()
            for resource in RESOURCES:  # at most one agent holds a live lease on each lock
                live = [a for (a, r), h in held.items() if r == resource and h.expires_at > now]
                assert len(live) <= 1, (resource, live)
    finally:
        for service in services:
            await service.close()
    for resource in RESOURCES:
        log = database.events.get(resource, [])
        tokens = [event.fencing_token for event in log if isinstance(event, LockAcquired)]
        assert tokens == sorted(set(tokens))  # strictly increasing
        logged = [(resource, event.type, event.fencing_token) for event in log]
        for event in (a for a in acknowledged if a[0] == resource):
            assert event in logged  # no acknowledged event lost


@settings(max_examples=40, deadline=None)
@given(st.lists(rounds, min_size=1, max_size=8))
async def test_a_fleet_keeps_one_holder_increasing_tokens_and_every_acknowledged_event(
    story: list[Round],
) -> None:
    await _play(story)
