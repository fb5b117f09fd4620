"""The fair queue's rule: while acquires wait for a lock, only the first of them may take it.

A waiting acquire holds a *ticket*, numbered in arrival order by the store; a ticket counts until its
deadline (its wait, so a waiter whose server died stops counting by itself). An acquire may be granted a
lock that is free (or whose lease lapsed) only if no live ticket precedes its own; an acquire without a
ticket (one that does not wait, or has not joined yet) is preceded by every live ticket, so it never
jumps the queue. The store enforces the same rule where the grant is serialized
(``service/lock_store.py``); this is the decision the use case makes on what it loaded.
"""

from __future__ import annotations

from datetime import datetime

from domain.errors import LockHeld
from domain.state import LockState
from domain.timestamps import format_timestamp
from domain.value import value


@value
class Ticket:
    """A waiting acquire's place in a lock's queue."""

    ticket: int
    owner: str
    deadline: datetime


def first_live(tickets: list[Ticket], now: datetime) -> Ticket | None:
    """The first ticket (lowest number) still live at ``now``: the queue's head."""
    live = [t for t in tickets if t.deadline > now]
    return min(live, key=lambda t: t.ticket) if live else None


def may_take(head: Ticket | None, ticket: int | None, now: datetime) -> bool:
    """Whether an acquire holding ``ticket`` (None: none) may take a free lock whose queue's first live
    ticket is ``head``."""
    if head is None or head.deadline <= now:
        return True
    return ticket is not None and ticket <= head.ticket


class QueueAhead(LockHeld):
    """The lock is free, but acquires that came first wait for it: ``holder`` and ``expires_at`` name the
    first of them and its deadline (when it stops counting even if it never leaves)."""

    def __init__(self, state: LockState, head: Ticket, now: datetime) -> None:
        detail = (
            f"{state.resource} is promised to {head.owner}, first of the acquires waiting for it"
            f" (until {format_timestamp(head.deadline)} at the latest)"
        )
        due_in_s = (head.deadline - now).total_seconds()
        super().__init__(state.resource, head.owner, head.deadline, state.fencing_token, due_in_s, detail)
        self.head = head


def check_turn(state: LockState, head: Ticket | None, ticket: int | None, now: datetime) -> None:
    """Refuse (``QueueAhead``) an acquire of a lock that is free or lapsed at ``now`` when a live ticket
    precedes ``ticket``; a held lock is the decider's to refuse."""
    if state.is_live(now) or head is None or may_take(head, ticket, now):
        return
    raise QueueAhead(state, head, now)
