"""saga_state: one row per saga, projected inline in the same statement as the saga's append.

Like lock_state for a lock, the row is the saga stream's head: its ``version`` is the expected version
the next append must match, and ``SELECT ... FOR UPDATE`` on it serializes concurrent transitions of one
saga. It holds the whole folded state (the steps as JSON), so a transition is decided on the row alone,
and it is indexed for ``GET /v1/sagas``'s filters (status, owner, name), each paginated by saga id.
The saga's lease is kept here too: ``lease_expires_at`` is stamped by every append of an unfinished saga
(its clock plus ``lease_ms``; NULL once the saga ends) and indexed for the reaper's pass
(``service/saga_lapse.py``); ``lease_lapsed_at`` is when the lease last lapsed with no heartbeat since.
``rebuild_saga_state`` recomputes it by folding the log with the pure decider.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from sqlalchemy import BigInteger, CheckConstraint, Column, Index, Integer, Table, Text, text
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP

from domain.saga import (
    SAGA_LEASE_EXPIRED,
    STREAM_PREFIX,
    TERMINAL,
    SagaState,
    StepState,
    evolve,
    initial_saga,
)
from eventstore.append import append_sql, event_rows
from eventstore.connection import Connection
from eventstore.payloads import timestamp_text_sql
from eventstore.saga_payloads import SAGA_EVENT_TYPES, saga_event_from_payload
from eventstore.schema import metadata

saga_state = Table(
    "saga_state",
    metadata,
    Column("saga_id", Text, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("name", Text, nullable=False),
    Column("owner", Text, nullable=False),
    Column("policy", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("reason", Text),
    Column("steps", JSONB, nullable=False),
    Column("started_at", TIMESTAMP(timezone=True), nullable=False),
    Column("updated_at", TIMESTAMP(timezone=True), nullable=False),
    Column("lease_ms", Integer),
    Column("lease_expires_at", TIMESTAMP(timezone=True)),
    Column("lease_lapsed_at", TIMESTAMP(timezone=True)),
    CheckConstraint(
        "status IN ('running', 'compensating', 'completed', 'aborted', 'stuck')",
        name="saga_state_status_check",
    ),
    CheckConstraint("policy IN ('compensate', 'forward')", name="saga_state_policy_check"),
    # GET /v1/sagas: each filter, paginated by saga id.
    Index("saga_state_status_idx", "status", "saga_id"),
    Index("saga_state_owner_idx", "owner", "saga_id"),
    Index("saga_state_name_idx", "name", "saga_id"),
    # The reaper's pass: unfinished sagas by lease deadline.
    Index(
        "saga_state_lease_idx",
        "lease_expires_at",
        postgresql_where=text("lease_expires_at IS NOT NULL"),
    ),
)

_COLUMNS = (
    "saga_id, version, name, owner, policy, status, reason, steps::text AS steps, started_at, updated_at,"
    " lease_ms, lease_expires_at, lease_lapsed_at"
)


def steps_json(state: SagaState) -> list[dict[str, Any]]:
    """The steps as the ``steps`` column holds them."""
    return [
        {
            "name": s.name, "locks": list(s.locks), "status": s.status, "result": s.result, "error": s.error,
            "compensation_failures": s.compensation_failures, "route": s.route,
            "reservation_id": s.reservation_id,
        }
        for s in state.steps
    ]  # fmt: skip


def saga_from_row(saga_id: str, row: Any) -> SagaState:
    """The decider's view of a saga_state row (the initial state when the row's columns are NULL)."""
    if row["version"] is None:
        return initial_saga(saga_id)
    steps = tuple(
        StepState(
            s["name"],
            tuple(s["locks"]),
            s["status"],
            s["result"],
            s["error"],
            int(s["compensation_failures"]),
            bool(s.get("route", False)),  # absent from rows written before route steps
            s.get("reservation_id"),
        )
        for s in json.loads(row["steps"])
    )
    return SagaState(
        saga_id, row["version"], row["name"], row["owner"], row["policy"], row["status"], row["reason"],
        steps, row["lease_ms"], row["lease_lapsed_at"] is not None, row["lease_expires_at"],
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class SagaRow:
    """A saga as read: its state and its instants (None for a saga never started); the lease deadline is
    ``state.lease_expires_at``."""

    state: SagaState
    started_at: datetime | None
    updated_at: datetime | None
    lease_lapsed_at: datetime | None = None


# The read before a transition: the head row and the Idempotency-Key's stored outcome.
LOAD_SQL = f"""
SELECT s.*, k.fingerprint, k.response::text AS response
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT {_COLUMNS} FROM saga_state WHERE saga_id = $1 LIMIT 1) AS s ON true
  LEFT JOIN LATERAL (
        SELECT fingerprint, response FROM idempotency_keys WHERE principal = $2 AND key = $3 LIMIT 1
       ) AS k ON true
"""


# One transition in one statement and so one transaction: lock the head at the expected version (or
# insert it for a new saga; a concurrent creator waits on the primary key, then loses), read the clock,
# move the head, append the events (eventstore/append.py: the same INSERT and hash chain as a lock's),
# and record the Idempotency-Key with the answer. A plan whose head moved writes nothing and gets no row.
COMMIT_SQL = f"""
WITH c AS (
    SELECT 1::bigint AS cmd, $1::text AS saga_id, $2::text AS resource, $3::bigint AS expected,
           $4::integer AS n_events, $5::jsonb AS metadata, $6::text AS name, $7::text AS owner,
           $8::text AS policy, $9::text AS status, $10::text AS reason, $11::jsonb AS steps,
           $12::text AS principal, $13::text AS key, $14::bytea AS fingerprint, $15::jsonb AS response,
           NULL::integer AS grant_ttl, NULL::timestamptz AS new_expires_at,
           $17::integer AS lease_ms, $18::boolean AS lapsed, $19::boolean AS lapsed_now
),
head AS (
    SELECT s.saga_id FROM c CROSS JOIN LATERAL (
           SELECT saga_id FROM saga_state WHERE saga_id = c.saga_id AND version = c.expected FOR UPDATE
           ) AS s
     WHERE c.expected > 0
),
clock AS (
    SELECT clock_timestamp() AS ts FROM (SELECT count(*) FROM head) AS every_head_locked
),
planned AS (
    SELECT c.*, clock.ts,
           CASE WHEN c.status IN ('running', 'compensating')
                THEN clock.ts + c.lease_ms * interval '1 millisecond' END AS lease_expires_at
      FROM c CROSS JOIN clock
),
fresh AS (
    INSERT INTO saga_state (saga_id, version, name, owner, policy, status, reason, steps, started_at,
                            updated_at, lease_ms, lease_expires_at)
    SELECT saga_id, n_events, name, owner, policy, status, reason, steps, ts, ts, lease_ms, lease_expires_at
      FROM planned WHERE expected = 0
        ON CONFLICT (saga_id) DO NOTHING
 RETURNING saga_id
),
ok AS (
    SELECT planned.* FROM planned JOIN head USING (saga_id)
    UNION ALL
    SELECT planned.* FROM planned JOIN fresh USING (saga_id)
),
projected AS (
    UPDATE saga_state AS s
       SET version = ok.expected + ok.n_events, status = ok.status, reason = ok.reason, steps = ok.steps,
           updated_at = ok.ts, lease_expires_at = ok.lease_expires_at,
           lease_lapsed_at = CASE WHEN NOT ok.lapsed THEN NULL WHEN ok.lapsed_now THEN ok.ts
                                  ELSE s.lease_lapsed_at END
      FROM ok
     WHERE ok.expected > 0 AND s.saga_id = ok.saga_id
 RETURNING 1
),
appended AS ({append_sql("ok", "$16::json")}
),
remembered AS (
    INSERT INTO idempotency_keys (principal, key, fingerprint, resource, response, created_at)
    SELECT principal, key, fingerprint, resource,
           response || jsonb_build_object('updated_at', {timestamp_text_sql("ts")},
                                          'lease_expires_at', {timestamp_text_sql("lease_expires_at")})
                    || CASE WHEN expected = 0
                            THEN jsonb_build_object('started_at', {timestamp_text_sql("ts")})
                            ELSE '{{}}'::jsonb END,
           ts
      FROM ok
     WHERE key IS NOT NULL
 RETURNING 1
)
SELECT ts FROM ok
"""


async def load_saga(
    conn: Connection, saga_id: str, principal: str, key: str | None
) -> tuple[SagaRow, tuple[bytes, str] | None]:
    """The saga's head and what ``key`` already produced for ``principal`` (if anything)."""
    row = await conn.fetchrow(LOAD_SQL, saga_id, principal, key)
    assert row is not None
    stored = None if row["fingerprint"] is None else (bytes(row["fingerprint"]), row["response"])
    return _saga_row(saga_id, row), stored


async def commit_saga(
    conn: Connection,
    *,
    expected: int,
    new_state: SagaState,
    events: list[tuple[str, dict[str, Any]]],
    metadata: dict[str, Any],
    principal: str,
    key: str | None,
    fingerprint: bytes,
    response: dict[str, Any],
) -> datetime | None:
    """Append ``events`` (type, payload) at ``expected`` + 1.. and move the head to ``new_state``, its
    lease deadline stamped from the clock; the instant of the append, or None when the head moved
    meanwhile (nothing written)."""
    state = new_state
    lapsed_now = any(event_type == SAGA_LEASE_EXPIRED for event_type, _ in events)
    ts: datetime | None = await conn.fetchval(
        COMMIT_SQL,
        state.saga_id, STREAM_PREFIX + state.saga_id, expected, len(events), json.dumps(metadata),
        state.name, state.owner, state.policy, state.status, state.reason, json.dumps(steps_json(state)),
        principal, key, fingerprint, json.dumps(response), json.dumps(event_rows([events])),
        state.lease_ms, state.lease_lapsed, lapsed_now,
    )  # fmt: skip
    return ts


# --- reads -------------------------------------------------------------------------------------------


async def get_saga(conn: Connection, saga_id: str) -> SagaRow | None:
    row = await conn.fetchrow(f"SELECT {_COLUMNS} FROM saga_state WHERE saga_id = $1", saga_id)
    return None if row is None else _saga_row(saga_id, row)


def _saga_row(saga_id: str, row: Any) -> SagaRow:
    return SagaRow(saga_from_row(saga_id, row), row["started_at"], row["updated_at"], row["lease_lapsed_at"])


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    position: int
    version: int
    type: str
    data: dict[str, Any]
    recorded_at: datetime


async def saga_timeline(conn: Connection, saga_id: str) -> list[TimelineEvent]:
    """The saga's events in stream order, read whole: its steps, plus a heartbeat every third of its lease
    while it runs (360 an hour with the SDK's default 30 s lease)."""
    rows = await conn.fetch(
        "SELECT position, stream_version, event_type, data::text AS data, recorded_at FROM events"
        " WHERE stream_id = $1 ORDER BY stream_version",
        STREAM_PREFIX + saga_id,
    )
    return [
        TimelineEvent(
            r["position"], r["stream_version"], r["event_type"], json.loads(r["data"]), r["recorded_at"]
        )
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class SagaPage:
    items: list[SagaRow]
    next_cursor: str | None


async def list_sagas(
    conn: Connection,
    *,
    status: str | None = None,
    owner: str | None = None,
    name: str | None = None,
    cursor: str | None = None,
    limit: int = 100,
) -> SagaPage:
    """Sagas by id after ``cursor``, filtered; each filter has an index ordered by saga id."""
    rows = await conn.fetch(
        f"""SELECT {_COLUMNS} FROM saga_state
             WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR owner = $2)
               AND ($3::text IS NULL OR name = $3) AND ($4::text IS NULL OR saga_id > $4)
             ORDER BY saga_id LIMIT $5""",
        status, owner, name, cursor, limit + 1,
    )  # fmt: skip
    items = [_saga_row(r["saga_id"], r) for r in rows[:limit]]
    return SagaPage(items, items[-1].state.saga_id if len(rows) > limit else None)


# --- rebuild -----------------------------------------------------------------------------------------

_SAGA_EVENTS_SQL = f"""
SELECT stream_id, stream_version, event_type, data::text AS data, recorded_at FROM events
 WHERE starts_with(stream_id, '{STREAM_PREFIX}') AND event_type = ANY($1::text[])
 ORDER BY stream_id, stream_version
"""


def _rows(events: Iterable[asyncpg.Record]) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    state: SagaState | None = None
    started: datetime | None = None
    updated: datetime | None = None
    lapsed_at: datetime | None = None

    def flush() -> None:
        if state is not None and state.status is not None and updated is not None:
            steps = json.dumps(steps_json(state))
            live = state.status not in TERMINAL and state.lease_ms is not None
            expires = updated + timedelta(milliseconds=state.lease_ms or 0) if live else None
            rows.append(
                (state.saga_id, state.version, state.name, state.owner, state.policy, state.status,
                 state.reason, steps, started, updated, state.lease_ms, expires,
                 lapsed_at if state.lease_lapsed else None)
            )  # fmt: skip

    for event in events:
        saga_id = event["stream_id"].removeprefix(STREAM_PREFIX)
        if state is None or state.saga_id != saga_id:
            flush()
            state, started, lapsed_at = initial_saga(saga_id), event["recorded_at"], None
        state = evolve(state, saga_event_from_payload(event["event_type"], json.loads(event["data"])))
        updated = event["recorded_at"]
        if event["event_type"] == SAGA_LEASE_EXPIRED:
            lapsed_at = updated
    flush()
    return rows


async def rebuild_saga_state(conn: Connection) -> int:
    """Replace every saga_state row by the one the log implies (a fold of each saga's events by
    ``domain.saga.evolve``), under an EXCLUSIVE lock every saga transition needs first; returns the number
    of rows. Run it in a transaction, as the schema owner (it deletes rows)."""
    await conn.execute("LOCK TABLE saga_state IN EXCLUSIVE MODE")
    await conn.execute("DELETE FROM saga_state")
    rows = _rows(await conn.fetch(_SAGA_EVENTS_SQL, sorted(SAGA_EVENT_TYPES)))
    if rows:
        await conn.executemany(
            "INSERT INTO saga_state (saga_id, version, name, owner, policy, status, reason, steps,"
            " started_at, updated_at, lease_ms, lease_expires_at, lease_lapsed_at)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10, $11, $12, $13)",
            rows,
        )
    return len(rows)
