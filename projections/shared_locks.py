"""shared_locks and shared_holders: the shared locks' heads and grants, projected inline in the same
statement as the append (docs/decisions/0051-shared-locks.md).

``shared_locks`` has one row per shared lock ever taken: its stream head. Its ``version`` is the expected
version the next append must match, and ``SELECT ... FOR UPDATE`` on it serializes concurrent commands on
one shared lock, as ``lock_state`` does for a mutex (and the fair queue's ``enter`` locks it too).
``shared_holders`` has a row per grant not yet released or expired (a lapsed grant stays until its
``SHARED_EXPIRED``), indexed by deadline for the reaper's pass.

A command is two round trips: ``load_shared`` (the head, the grants, the clock, the Idempotency-Key's
stored outcome and the queue's first tickets) and ``commit_shared`` (one statement: lock the head at the
expected version, read the clock, re-check that a renewed or released grant is still live and that no
waiter has the prior claim on a grant, append, project, dequeue, remember the key). ``rebuild_shared_locks``
recomputes both tables by folding the log with the pure decider.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, Column, Index, Integer, PrimaryKeyConstraint, Table, Text
from sqlalchemy.dialects.postgresql import TIMESTAMP

from domain.queue import Ticket
from domain.shared_lock import (
    EXCLUSIVE,
    SHARED,
    SHARED_EVENT_TYPES,
    STREAM_PREFIX,
    Grant,
    Mode,
    SharedAcquired,
    SharedLockState,
    evolve,
    shared_event_from_payload,
    stream_id,
)
from eventstore.append import append_sql, event_rows
from eventstore.connection import Connection
from eventstore.payloads import deadline_sql, timestamp_text_sql
from eventstore.schema import metadata

shared_locks = Table(
    "shared_locks",
    metadata,
    Column("resource", Text, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("updated_at", TIMESTAMP(timezone=True), nullable=False),
)

shared_holders = Table(
    "shared_holders",
    metadata,
    Column("resource", Text, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("owner", Text, nullable=False),
    Column("mode", Text, nullable=False),
    Column("lock_limit", Integer),
    Column("ttl_ms", Integer, nullable=False),
    Column("granted_at", TIMESTAMP(timezone=True), nullable=False),
    Column("expires_at", TIMESTAMP(timezone=True), nullable=False),
    PrimaryKeyConstraint("resource", "fencing_token", name="shared_holders_pkey"),
    CheckConstraint("mode IN ('shared', 'exclusive')", name="shared_holders_mode_check"),
    # The reaper's pass: grants by deadline.
    Index("shared_holders_expires_at_idx", "expires_at"),
)


@dataclass(frozen=True, slots=True)
class SharedSnapshot:
    """What a decision needs: the state, the database clock, the key's stored outcome (fingerprint,
    response text), and the queue's first live ticket and first live exclusive one."""

    state: SharedLockState
    db_now: datetime
    stored: tuple[bytes, str] | None
    first: Ticket | None
    first_exclusive: Ticket | None


_LIVE_GRANTS = """
SELECT fencing_token, owner, mode, lock_limit, ttl_ms, expires_at, granted_at
  FROM shared_holders WHERE resource = $1 AND expires_at > clock_timestamp() ORDER BY fencing_token
"""

LOAD_SQL = """
SELECT clock_timestamp() AS db_now, h.version, g.grants::text AS grants,
       k.fingerprint, k.response::text AS response,
       f.ticket AS f_ticket, f.owner AS f_owner, f.deadline AS f_deadline,
       x.ticket AS x_ticket, x.owner AS x_owner, x.deadline AS x_deadline
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT version FROM shared_locks WHERE resource = $1) AS h ON true
  LEFT JOIN LATERAL (
        SELECT json_agg(json_build_object(
                   'fencing_token', fencing_token, 'owner', owner, 'mode', mode, 'lock_limit', lock_limit,
                   'ttl_ms', ttl_ms, 'expires_at', expires_at) ORDER BY fencing_token) AS grants
          FROM shared_holders WHERE resource = $1
       ) AS g ON true
  LEFT JOIN LATERAL (
        SELECT fingerprint, response FROM idempotency_keys WHERE principal = $3 AND key = $4 LIMIT 1
       ) AS k ON true
  LEFT JOIN LATERAL (
        SELECT ticket, owner, deadline FROM lock_queue
         WHERE resource = $2 AND deadline > clock_timestamp() ORDER BY ticket LIMIT 1
       ) AS f ON true
  LEFT JOIN LATERAL (
        SELECT ticket, owner, deadline FROM lock_queue
         WHERE resource = $2 AND exclusive AND deadline > clock_timestamp() ORDER BY ticket LIMIT 1
       ) AS x ON true
"""


def _grant(row: Any) -> Grant:
    mode: Mode = EXCLUSIVE if row["mode"] == EXCLUSIVE else SHARED
    return Grant(
        row["owner"], mode, row["lock_limit"], row["fencing_token"], row["ttl_ms"], row["expires_at"]
    )


def _ticket(row: Any, prefix: str) -> Ticket | None:
    if row[f"{prefix}_ticket"] is None:
        return None
    return Ticket(row[f"{prefix}_ticket"], row[f"{prefix}_owner"], row[f"{prefix}_deadline"])


async def load_shared(conn: Connection, resource: str, principal: str, key: str | None) -> SharedSnapshot:
    """The shared lock on ``resource`` as a decision needs it (one statement: the head and the grants
    agree)."""
    row = await conn.fetchrow(LOAD_SQL, resource, stream_id(resource), principal, key)
    assert row is not None
    grants = [
        {**g, "expires_at": datetime.fromisoformat(g["expires_at"])}
        for g in json.loads(row["grants"] or "[]")
    ]
    state = SharedLockState(resource, row["version"] or 0, tuple(_grant(g) for g in grants))
    stored = None if row["fingerprint"] is None else (bytes(row["fingerprint"]), row["response"])
    return SharedSnapshot(state, row["db_now"], stored, _ticket(row, "f"), _ticket(row, "x"))


# One command in one statement and so one transaction: lock the head at the expected version (or insert
# it for a lock never taken; a concurrent creator waits on the primary key, then gets no row), read the
# clock once the head is locked, and stand only if a renewed or released grant is still live then and no
# waiter has the prior claim on a grant (shared_queue_ahead, a fresh snapshot: migration 0016). Then move
# the head, delete the ended grants, insert or renew the granted one (its deadline: the clock plus its
# TTL, written to the row, the event and the answer alike), append, dequeue the grant's ticket and
# remember the key. A plan that fails a check writes nothing and gets no row.
COMMIT_SQL = f"""
WITH c AS (
    SELECT 1::bigint AS cmd, $1::text AS lock_resource, $2::text AS resource, $3::bigint AS expected,
           $4::integer AS n_events, $5::jsonb AS metadata, $6::text AS principal, $7::text AS key,
           $8::bytea AS fingerprint, $9::jsonb AS response, $11::integer AS grant_ttl,
           $12::bigint AS grant_token, $13::text AS grant_owner, $14::text AS grant_mode,
           $15::integer AS grant_limit, $16::bigint[] AS ended, $17::bigint AS live_token,
           $18::bigint AS ticket, $19::boolean AS acquires, $20::boolean AS waits_for_every_ticket
),
head AS (
    SELECT h.resource FROM c CROSS JOIN LATERAL (
           SELECT resource FROM shared_locks WHERE resource = c.lock_resource AND version = c.expected
              FOR UPDATE
           ) AS h
     WHERE c.expected > 0
),
clock AS (
    SELECT clock_timestamp() AS ts FROM (SELECT count(*) FROM head) AS every_head_locked
),
planned AS (
    SELECT c.*, clock.ts,
           CASE WHEN c.grant_ttl IS NOT NULL THEN {deadline_sql("clock.ts", "c.grant_ttl")} END
               AS new_expires_at
      FROM c CROSS JOIN clock
),
fresh AS (
    INSERT INTO shared_locks (resource, version, updated_at)
    SELECT lock_resource, n_events, ts FROM planned WHERE expected = 0
        ON CONFLICT (resource) DO NOTHING
 RETURNING resource
),
ok AS (
    SELECT planned.* FROM planned
     WHERE (EXISTS (SELECT 1 FROM head) OR EXISTS (SELECT 1 FROM fresh))
       AND (planned.live_token IS NULL OR EXISTS (
            SELECT 1 FROM shared_holders s
             WHERE s.resource = planned.lock_resource AND s.fencing_token = planned.live_token
               AND s.expires_at > planned.ts))
       AND (NOT planned.acquires OR NOT shared_queue_ahead(
            planned.resource, planned.ticket, planned.ts, NOT planned.waits_for_every_ticket))
),
moved AS (
    UPDATE shared_locks AS h SET version = ok.expected + ok.n_events, updated_at = ok.ts
      FROM ok WHERE ok.expected > 0 AND h.resource = ok.lock_resource
 RETURNING 1
),
ended AS (
    DELETE FROM shared_holders AS s USING ok
     WHERE s.resource = ok.lock_resource AND s.fencing_token = ANY(ok.ended)
 RETURNING 1
),
granted AS (
    INSERT INTO shared_holders (resource, fencing_token, owner, mode, lock_limit, ttl_ms, granted_at,
                                expires_at)
    SELECT lock_resource, grant_token, grant_owner, grant_mode, grant_limit, grant_ttl, ts, new_expires_at
      FROM ok WHERE acquires
 RETURNING 1
),
renewed AS (
    UPDATE shared_holders AS s SET ttl_ms = ok.grant_ttl, expires_at = ok.new_expires_at
      FROM ok
     WHERE NOT ok.acquires AND ok.grant_ttl IS NOT NULL
       AND s.resource = ok.lock_resource AND s.fencing_token = ok.grant_token
 RETURNING 1
),
appended AS ({append_sql("ok", "$10::json")}
),
dequeued AS (
    DELETE FROM lock_queue WHERE ticket = (SELECT ok.ticket FROM ok WHERE ok.acquires)
),
answered AS (
    SELECT ok.*,
           CASE WHEN ok.grant_ttl IS NULL THEN ok.response
                ELSE ok.response
                     || jsonb_build_object('expires_at', {timestamp_text_sql("ok.new_expires_at")})
            END AS body
      FROM ok
),
remembered AS (
    INSERT INTO idempotency_keys (principal, key, fingerprint, resource, response, created_at)
    SELECT principal, key, fingerprint, resource, body, ts FROM answered WHERE key IS NOT NULL
 RETURNING 1
)
SELECT ts, new_expires_at,
       EXISTS (SELECT 1 FROM lock_queue q
                WHERE q.resource = answered.resource AND q.deadline > answered.ts
                  AND q.ticket IS DISTINCT FROM answered.ticket) AS queued
  FROM answered
"""


@dataclass(frozen=True, slots=True)
class PlannedGrant:
    """A grant acquired or renewed, as planned: its deadline is the append's to stamp."""

    owner: str
    mode: Mode
    limit: int | None
    fencing_token: int
    ttl_ms: int


@dataclass(frozen=True, slots=True)
class SharedPlan:
    """The append that carries out a decision on a shared lock: its events as (type, payload), and what
    the projection needs of them."""

    resource: str
    expected_version: int
    events: list[tuple[str, dict[str, Any]]]
    metadata: dict[str, Any]
    principal: str
    key: str | None
    fingerprint: bytes
    response: dict[str, Any]
    grant: PlannedGrant | None = None  # the grant acquired or renewed
    acquires: bool = False
    ended: tuple[int, ...] = ()  # tokens of the grants released or expired
    live_token: int | None = None  # a renew or release: stands only while this grant is live
    ticket: int | None = None
    waits_for_every_ticket: bool = True  # an exclusive or limited grant; a reader waits for writers only


@dataclass(frozen=True, slots=True)
class SharedCommitted:
    """A commit's instant, a grant's deadline, and whether acquires still queue for the lock."""

    ts: datetime
    expires_at: datetime | None
    queued: bool


async def commit_shared(conn: Connection, plan: SharedPlan) -> SharedCommitted | None:
    """Append ``plan`` and project it; None when the head moved, the grant lapsed or a waiter came first
    (nothing written)."""
    grant = plan.grant
    row = await conn.fetchrow(
        COMMIT_SQL,
        plan.resource, stream_id(plan.resource), plan.expected_version, len(plan.events),
        json.dumps(plan.metadata), plan.principal, plan.key, plan.fingerprint, json.dumps(plan.response),
        json.dumps(event_rows([plan.events])),
        None if grant is None else grant.ttl_ms, None if grant is None else grant.fencing_token,
        None if grant is None else grant.owner, None if grant is None else grant.mode,
        None if grant is None else grant.limit, list(plan.ended), plan.live_token, plan.ticket,
        plan.acquires, plan.waits_for_every_ticket,
    )  # fmt: skip
    if row is None:
        return None
    return SharedCommitted(row["ts"], row["new_expires_at"], row["queued"])


# --- reads ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Holder:
    """A grant as ``GET /v1/shared-locks/{resource}`` shows it."""

    grant: Grant
    granted_at: datetime


async def holders_of(conn: Connection, resource: str) -> list[Holder]:
    """The live grants of ``resource``, in token order."""
    return [Holder(_grant(row), row["granted_at"]) for row in await conn.fetch(_LIVE_GRANTS, resource)]


# Live grants (deadline ahead), by resource and token, after the cursor's (resource, token). "Now" is the
# statement's start, one instant for every row; the outer join reads it even when no grant matches.
_LIST_SQL = """
SELECT c.now AS db_now, g.*
  FROM (SELECT statement_timestamp() AS now) AS c
  LEFT JOIN LATERAL (
        SELECT resource, fencing_token, owner, mode, lock_limit, ttl_ms, granted_at, expires_at
          FROM shared_holders
         WHERE expires_at > c.now
           AND ($1::text IS NULL OR starts_with(resource, $1))
           AND ($2::text IS NULL OR owner = $2)
           AND ($3::text IS NULL OR (resource, fencing_token) > ($3, $4::bigint))
         ORDER BY resource, fencing_token
         LIMIT $5
       ) AS g ON true
"""


@dataclass(frozen=True, slots=True)
class ListedGrant:
    """A live grant of some shared lock, as ``GET /v1/shared-locks`` lists it."""

    resource: str
    holder: Holder


@dataclass(frozen=True, slots=True)
class GrantPage:
    at: datetime  # the instant the page is as of: the statement's start
    items: list[ListedGrant]
    next_cursor: tuple[str, int] | None  # the last (resource, token) listed, when more follow


async def list_grants(
    conn: Connection,
    *,
    prefix: str | None = None,
    holder: str | None = None,
    cursor: tuple[str, int] | None = None,
    limit: int = 100,
) -> GrantPage:
    """Live grants of every shared lock, ordered by resource then token, after ``cursor``; one round
    trip, as ``projections.queries.list_locks``."""
    after, token = cursor if cursor is not None else (None, None)
    rows = await conn.fetch(_LIST_SQL, prefix or None, holder, after, token, limit + 1)
    live = [row for row in rows if row["resource"] is not None]
    items = [ListedGrant(row["resource"], Holder(_grant(row), row["granted_at"])) for row in live[:limit]]
    last = items[-1] if len(live) > limit else None
    next_cursor = None if last is None else (last.resource, last.holder.grant.fencing_token)
    return GrantPage(rows[0]["db_now"], items, next_cursor)


DUE_SQL = """
SELECT DISTINCT resource FROM (
       SELECT resource FROM shared_holders WHERE expires_at <= clock_timestamp()
        ORDER BY expires_at LIMIT $1) AS due
"""


async def due_shared(conn: Connection, limit: int) -> list[str]:
    """Shared locks with a grant whose deadline has passed (at most ``limit`` grants' worth)."""
    return [row["resource"] for row in await conn.fetch(DUE_SQL, limit)]


# --- rebuild -------------------------------------------------------------------------------------------

_SHARED_EVENTS_SQL = f"""
SELECT stream_id, event_type, data::text AS data, recorded_at FROM events
 WHERE starts_with(stream_id, '{STREAM_PREFIX}') AND event_type = ANY($1::text[])
 ORDER BY stream_id, stream_version
"""


async def rebuild_shared_locks(conn: Connection) -> int:
    """Replace every shared_locks and shared_holders row by what the log implies (each stream folded by
    ``domain.shared_lock.evolve``, a grant's ``granted_at`` its acquire's instant), under an EXCLUSIVE lock
    on shared_locks, which every command takes a row of first; returns the number of locks. Run it in a
    transaction, as the schema owner (it deletes rows)."""
    await conn.execute("LOCK TABLE shared_locks IN EXCLUSIVE MODE")
    await conn.execute("DELETE FROM shared_holders")
    await conn.execute("DELETE FROM shared_locks")
    heads: list[tuple[str, int, datetime]] = []
    holders: list[tuple[Any, ...]] = []
    state: SharedLockState | None = None
    updated_at: datetime | None = None
    granted_at: dict[int, datetime] = {}

    def flush() -> None:
        if state is None or updated_at is None:
            return
        heads.append((state.resource, state.version, updated_at))
        holders.extend(
            (state.resource, g.fencing_token, g.owner, g.mode, g.limit, g.ttl_ms, granted_at[g.fencing_token],
             g.expires_at)
            for g in state.grants
        )  # fmt: skip

    for row in await conn.fetch(_SHARED_EVENTS_SQL, sorted(SHARED_EVENT_TYPES)):
        resource = row["stream_id"].removeprefix(STREAM_PREFIX)
        if state is None or state.resource != resource:
            flush()
            state, granted_at = SharedLockState(resource), {}
        event = shared_event_from_payload(resource, row["event_type"], json.loads(row["data"]))
        if isinstance(event, SharedAcquired):
            granted_at[event.fencing_token] = row["recorded_at"]
        state, updated_at = evolve(state, event), row["recorded_at"]
    flush()
    await conn.executemany(
        "INSERT INTO shared_locks (resource, version, updated_at) VALUES ($1, $2, $3)", heads
    )
    await conn.executemany(
        "INSERT INTO shared_holders (resource, fencing_token, owner, mode, lock_limit, ttl_ms, granted_at,"
        " expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        holders,
    )
    return len(heads)
