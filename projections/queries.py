"""Read-side queries for dashboards: one lock, and current locks with filters.

Each lock carries the length of its fair queue (``lock_queue``, migration 0015: live tickets), counted
in the same statement by a probe of the queue's (resource, ticket) index per lock shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from sqlalchemy import ColumnElement, and_, column, func, select, table

from domain.state import is_expired
from eventstore.connection import Connection
from projections.schema import lock_state
from projections.sql import compile_query


@dataclass(frozen=True, slots=True)
class LockView:
    """A lock as a dashboard shows it. ``status`` is ``held``, ``free``, or ``expired`` for a lease whose
    deadline passed but whose ``LOCK_EXPIRED`` the reaper has not appended yet (it is not live)."""

    resource: str
    status: str
    owner: str | None
    fencing_token: int
    ttl_ms: int | None
    expires_at: datetime | None
    acquired_at: datetime | None
    updated_at: datetime
    version: int
    ended_by: str | None
    saga_id: str | None = None  # the saga the live lease was acquired in (X-Saga-ID); None otherwise
    saga_step: str | None = None
    handed_off_by: str | None = None  # the giver of a hand-off the live holder has not yet taken up
    reservation_id: str | None = None  # the reservation the live lease was taken in (decision 0048)
    queued: int = 0  # acquires waiting in the lock's fair queue (live tickets)

    def as_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "status": self.status,
            "owner": self.owner,
            "fencing_token": self.fencing_token,
            "ttl_ms": self.ttl_ms,
            "expires_at": self.expires_at,
            "acquired_at": self.acquired_at,
            "updated_at": self.updated_at,
            "version": self.version,
            "ended_by": self.ended_by,
            "saga_id": self.saga_id,
            "saga_step": self.saga_step,
            "handed_off_by": self.handed_off_by,
            "reservation_id": self.reservation_id,
            "queued": self.queued,
        }


def _view(row: asyncpg.Record, now: datetime) -> LockView:
    status = row["status"]
    if status == "held" and is_expired(row["expires_at"], now):
        status = "expired"
    return LockView(
        resource=row["resource"],
        status=status,
        owner=row["owner"],
        fencing_token=row["fencing_token"],
        ttl_ms=row["ttl_ms"],
        expires_at=row["expires_at"],
        acquired_at=row["acquired_at"],
        updated_at=row["updated_at"],
        version=row["version"],
        ended_by=row["ended_by"],
        # lock_state keeps the saga of the last acquire after the lease ends: shown for a live lease only.
        saga_id=row["saga_id"] if status == "held" else None,
        saga_step=row["saga_step"] if status == "held" else None,
        handed_off_by=row["handed_off_by"] if status == "held" else None,
        reservation_id=row["reservation_id"] if status == "held" else None,
        queued=row["queued"],
    )


# The fair queue's table (service/schema.py declares it; this layer names only the columns it reads).
_lock_queue = table("lock_queue", column("resource"), column("deadline"))


def _queued(now: ColumnElement[Any]) -> ColumnElement[int]:
    """The number of live tickets queued for the lock_state row at hand, as a column."""
    return (
        select(func.count())
        .select_from(_lock_queue)
        .where(_lock_queue.c.resource == lock_state.c.resource, _lock_queue.c.deadline > now)
        .scalar_subquery()
        .label("queued")
    )


async def get_lock(conn: Connection, resource: str) -> LockView | None:
    sql, params = compile_query(
        select(lock_state, func.clock_timestamp().label("db_now"), _queued(func.clock_timestamp())).where(
            lock_state.c.resource == resource
        )
    )
    row = await conn.fetchrow(sql, *params)
    return None if row is None else _view(row, row["db_now"])


async def count_live_leases(conn: Connection) -> int:
    """Leases held now (deadline ahead), across the whole table: a count over the held rows' deadline
    index, cheap enough to run at every metrics scrape."""
    now = func.statement_timestamp()
    sql, params = compile_query(
        select(func.count())
        .select_from(lock_state)
        .where(and_(lock_state.c.status == "held", lock_state.c.expires_at > now))
    )
    count = await conn.fetchval(sql, *params)
    return int(count)


@dataclass(frozen=True, slots=True)
class LockPage:
    at: datetime  # the instant the page is as of: the statement's start, when its snapshot was taken
    items: list[LockView]
    next_cursor: str | None


async def list_locks(
    conn: Connection,
    *,
    holder: str | None = None,
    prefix: str | None = None,
    expiring_within_ms: int | None = None,
    cursor: str | None = None,
    limit: int = 100,
) -> LockPage:
    """Live leases (held, deadline ahead), ordered by resource; ``cursor`` is the last resource seen.

    "Now" is the statement's own start time, one instant for every row and the moment its snapshot was
    taken, so the page needs a single round trip; it is read even when no lease matches (the outer join),
    so the page can say which instant it shows.
    """
    clock = select(func.statement_timestamp().label("now")).cte("clock")
    now = clock.c.now
    conditions = [lock_state.c.status == "held", lock_state.c.expires_at > now]
    if holder is not None:
        conditions.append(lock_state.c.owner == holder)
    if prefix:
        conditions.append(lock_state.c.resource.startswith(prefix, autoescape=True))
    if expiring_within_ms is not None:
        conditions.append(lock_state.c.expires_at <= now + timedelta(milliseconds=expiring_within_ms))
    if cursor is not None:
        conditions.append(lock_state.c.resource > cursor)
    sql, params = compile_query(
        select(lock_state, now.label("db_now"), _queued(now))
        .select_from(clock.outerjoin(lock_state, and_(*conditions)))
        .order_by(lock_state.c.resource)
        .limit(limit + 1)
    )
    rows = await conn.fetch(sql, *params)
    held = [row for row in rows if row["resource"] is not None]
    items = [_view(row, row["db_now"]) for row in held[:limit]]
    next_cursor = items[-1].resource if len(held) > limit else None
    return LockPage(rows[0]["db_now"], items, next_cursor)
