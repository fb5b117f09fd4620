"""What a benchmark target offers the agents: per-agent acquire, renew and release.

``acquire`` returns the grant's token, or None when the lock is held by someone else (a conflict); any
other failure raises. ``renew`` and ``release`` return nothing and raise on failure (a 409 there is an
error: the agent holds the lock it names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class CommandFailed(Exception):
    """A response that is neither a success nor the expected conflict (e.g. HTTP 500, 410, 422)."""


@dataclass(frozen=True)
class Safety:
    """What the hot mode may check of this target's grants."""

    exclusive: bool  # one holder at a time
    monotonic_tokens: bool  # tokens strictly increase per resource


class Agent(Protocol):
    async def acquire(self, resource: str) -> Any | None: ...

    async def renew(self, resource: str, token: Any) -> None: ...

    async def release(self, resource: str, token: Any) -> None: ...


class Target(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def safety(self) -> Safety | None:
        """What the hot mode checks; None for what is not a lock (the no-op twin)."""

    async def open(self) -> None:
        """Once per run: connect, create tables."""

    async def start_cell(self, workers: int) -> None:
        """Before each cell: size pools and connections for ``workers`` agents."""

    def agent(self, index: int) -> Agent:
        """Agent ``index``'s handle (its owner id and, for HTTP, its connection)."""

    async def end_cell(self) -> None: ...

    async def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """How this target is configured, for the JSON output."""
