"""The appends this process has in flight, per resource, so a command can wait for them to settle.

A command decided while an append on its resource is still on its way would be decided on the state
before that append: when the lock is contended, an acquire decided on "free" just as another agent's
acquire is being appended. The database refuses it (the stream moved), and the command must read and
decide again: a wasted round trip for every conflict on a hot resource. Waiting for the appends in
flight costs nothing (they settle within a round trip) and lets the command decide on the state they
left, which the service remembers. It also gives the commands on one resource in one process a turn
each, in arrival order, as the database would serialize them anyway.
"""

from __future__ import annotations

import asyncio


class _Turn:
    __slots__ = ("appends", "settled")

    def __init__(self) -> None:
        self.appends = 0
        self.settled: asyncio.Event | None = None  # made by the first command that waits


class AppendsInFlight:
    def __init__(self) -> None:
        self._turns: dict[str, _Turn] = {}

    def begin(self, resource: str) -> None:
        turn = self._turns.get(resource)
        if turn is None:
            turn = self._turns[resource] = _Turn()
        turn.appends += 1

    def end(self, resource: str) -> None:
        turn = self._turns[resource]
        turn.appends -= 1
        if turn.appends == 0:
            del self._turns[resource]
            if turn.settled is not None:
                turn.settled.set()

    def busy(self, resource: str) -> bool:
        """Whether an append on ``resource`` is in flight (the cheap check before ``settled``)."""
        return resource in self._turns

    async def settled(self, resource: str) -> None:
        """Return once no append on ``resource`` is in flight (at once when none is)."""
        while (turn := self._turns.get(resource)) is not None:
            if turn.settled is None:
                turn.settled = asyncio.Event()
            await turn.settled.wait()

    def __len__(self) -> int:
        """Resources with an append in flight."""
        return len(self._turns)
