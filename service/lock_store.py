"""The lock stream's unit of work, in two database round trips per command (one when the service decides
on a state it remembers, ``service/state_cache.py``: then only the commit).

1. ``load``: one statement reads the stream head (the ``lock_state`` row), the database clock and any
   stored outcome of the request's Idempotency-Key.
2. ``commit``: one statement, hence one short transaction, that
   - locks the stream head and checks the expected version (the serialization point of the resource),
   - reads ``clock_timestamp()`` *after* that lock is held and re-checks that a renewed or released lease
     is still live at that instant,
   - appends the events (stream version = expected + n; the hash chain is set by a trigger),
   - updates the inline ``lock_state`` projection,
   - records the Idempotency-Key with the exact response body,
   and returns that body. If the version moved or the lease lapsed meanwhile, it writes nothing and
   returns no row: the caller loads again and decides again.

The SQL is hand-written rather than built with SQLAlchemy because it is the hot path: one prepared
statement per shape, cached by asyncpg. The tables it touches are defined in ``*/schema.py``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

import asyncpg
from pydantic_core import to_json

from domain.events import GRANTING_EVENTS, LOCK_ACQUIRED, Event, event_payload
from domain.state import LockState
from domain.timestamps import SQL_TIMESTAMP_FORMAT
from domain.value import value
from eventstore.connection import Connection
from eventstore.event_ids import new_event_ids
from projections.schema import lock_state_from_row

LOAD_SQL = """
SELECT clock_timestamp() AS db_now,
       s.version, s.status, s.owner, s.fencing_token, s.ttl_ms, s.expires_at, s.ended_by,
       k.fingerprint, k.status_code, k.response::text AS response
  FROM (SELECT) AS one
  LEFT JOIN lock_state AS s ON s.resource = $1::text
  LEFT JOIN idempotency_keys AS k ON k.principal = $2::text AND k.key = $3::text
"""

# Serialization point of an existing stream: its head row, locked, at the expected version.
_EXISTING_HEAD = """
WITH head AS (
    SELECT expires_at FROM lock_state
     WHERE resource = $1::text AND version = $2::bigint
       FOR UPDATE
),
clock AS (
    SELECT clock_timestamp() AS ts, head.expires_at AS held_until FROM head
),
stamped AS (
    SELECT ts,
           CASE WHEN $4::integer IS NULL THEN $12::timestamptz
                ELSE ts + $4::integer * interval '1 millisecond' END AS new_expires_at
      FROM clock
     WHERE NOT $3::boolean OR ts < held_until
),
projected AS (
    UPDATE lock_state
       SET version = $2::bigint + cardinality($5::text[]), status = $8::text, owner = $9::text,
           fencing_token = $10::bigint, ttl_ms = $11::integer, expires_at = stamped.new_expires_at,
           ended_by = $13::text,
           acquired_at = CASE WHEN 'LOCK_ACQUIRED' = ANY($5::text[]) THEN stamped.ts
                              ELSE lock_state.acquired_at END,
           updated_at = stamped.ts
      FROM stamped
     WHERE lock_state.resource = $1::text
 RETURNING lock_state.resource
),"""

# Serialization point of a new stream: inserting its head row; a concurrent creator waits, then loses.
_NEW_HEAD = """
WITH stamped AS (
    SELECT ts,
           CASE WHEN $4::integer IS NULL THEN $12::timestamptz
                ELSE ts + $4::integer * interval '1 millisecond' END AS new_expires_at
      FROM (SELECT clock_timestamp() AS ts) AS clock
     WHERE $2::bigint = 0 AND NOT $3::boolean
),
projected AS (
    INSERT INTO lock_state (resource, version, status, owner, fencing_token, ttl_ms, expires_at,
                            ended_by, acquired_at, updated_at)
    SELECT $1::text, cardinality($5::text[]), $8::text, $9::text, $10::bigint, $11::integer,
           new_expires_at, $13::text,
           CASE WHEN 'LOCK_ACQUIRED' = ANY($5::text[]) THEN ts END, ts
      FROM stamped
        ON CONFLICT (resource) DO NOTHING
 RETURNING resource
),"""


def _answer_text(instant: str) -> str:
    """SQL writing ``instant`` as every answer writes one (domain/timestamps.py). The response body is
    built in the statement that stores it under its Idempotency-Key, so a replay is the first answer
    byte for byte."""
    return f"to_char({instant} AT TIME ZONE 'UTC', '{SQL_TIMESTAMP_FORMAT}')"


# Shared by both shapes: append the events, record the idempotency key, return the response body.
_APPEND_TAIL = f"""
appended AS (
    INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata, recorded_at)
    SELECT $1::text, $2::bigint + e.ord, e.event_id, e.event_type,
           CASE WHEN $4::integer IS NOT NULL AND e.ord = cardinality($5::text[])
                THEN e.data || jsonb_build_object('expires_at', stamped.new_expires_at)
                ELSE e.data END,
           $7::jsonb, stamped.ts
      FROM stamped, projected,
           unnest($5::text[], $6::jsonb[], $19::uuid[]) WITH ORDINALITY AS e(event_type, data, event_id, ord)
 RETURNING position
),
response AS (
    SELECT CASE WHEN $4::integer IS NULL THEN $18::jsonb
                ELSE $18::jsonb || jsonb_build_object('expires_at', {_answer_text("stamped.new_expires_at")})
            END AS body
      FROM stamped, projected
),
remembered AS (
    INSERT INTO idempotency_keys (principal, key, fingerprint, resource, status_code, response, created_at)
    SELECT $14::text, $15::text, $16::bytea, $1::text, $17::smallint, response.body, stamped.ts
      FROM stamped, response
     WHERE $15::text IS NOT NULL
 RETURNING 1
)
SELECT response.body::text AS response, stamped.new_expires_at AS expires_at
  FROM stamped, response
"""

COMMIT_EXISTING_SQL = _EXISTING_HEAD + _APPEND_TAIL
COMMIT_NEW_SQL = _NEW_HEAD + _APPEND_TAIL


@value
class StoredOutcome:
    """What an Idempotency-Key already produced."""

    fingerprint: bytes
    status_code: int
    response: str


@value
class Snapshot:
    db_now: datetime
    state: LockState
    stored: StoredOutcome | None


@value
class Idempotency:
    principal: str
    key: str | None
    fingerprint: bytes


@value
class AppendPlan:
    """A decision ready to be committed: the events, the state they lead to, and the response."""

    expected_version: int
    events: list[Event]
    new_state: LockState
    require_live: bool
    status_code: int
    response: dict[str, Any]
    metadata: dict[str, Any]
    idempotency: Idempotency


@value
class Committed:
    response: str  # the JSON body, byte for byte what the Idempotency-Key record holds
    expires_at: datetime | None  # the lease deadline as stored (a grant's is stamped by the statement)


# The same read for many commands at once: one round trip for every command waiting to load. Each row is
# looked up by key (LATERAL), never joined: see "Plans that stay index probes" above COMMIT_MANY_SQL.
LOAD_MANY_SQL = """
SELECT q.ord, clock_timestamp() AS db_now,
       s.version, s.status, s.owner, s.fencing_token, s.ttl_ms, s.expires_at, s.ended_by,
       k.fingerprint, k.status_code, k.response::text AS response
  FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS q(resource, principal, key, ord)
  LEFT JOIN LATERAL (
        SELECT version, status, owner, fencing_token, ttl_ms, expires_at, ended_by
          FROM lock_state WHERE resource = q.resource
         LIMIT 1
       ) AS s ON true
  LEFT JOIN LATERAL (
        SELECT fingerprint, status_code, response
          FROM idempotency_keys WHERE principal = q.principal AND key = q.key
         LIMIT 1
       ) AS k ON true
 ORDER BY q.ord
"""


async def load(conn: Connection, resource: str, principal: str, key: str | None) -> Snapshot:
    row = await conn.fetchrow(LOAD_SQL, resource, principal, key)
    assert row is not None
    return _snapshot(resource, row)


async def load_many(conn: Connection, requests: list[tuple[str, str, str | None]]) -> list[Snapshot]:
    """``load`` for several (resource, principal, key) at once, in request order."""
    rows = await conn.fetch(
        LOAD_MANY_SQL, [r[0] for r in requests], [r[1] for r in requests], [r[2] for r in requests]
    )
    return [_snapshot(request[0], row) for request, row in zip(requests, rows, strict=True)]


def _snapshot(resource: str, row: asyncpg.Record) -> Snapshot:
    state = lock_state_from_row(resource, row)
    stored = None
    if row["fingerprint"] is not None:
        stored = StoredOutcome(bytes(row["fingerprint"]), row["status_code"], row["response"])
    return Snapshot(db_now=row["db_now"], state=state, stored=stored)


class _Parameters(NamedTuple):
    """The commit statement's parameters for one plan, in ``$1..$18`` order (see ``_EXISTING_HEAD``); ``$19``,
    the event ids, are made as it is sent."""

    resource: str
    expected_version: int
    require_live: bool
    grant_ttl_ms: int | None
    event_types: list[str]
    event_data: list[dict[str, Any]]
    metadata: dict[str, Any]
    status: str
    owner: str | None
    fencing_token: int
    ttl_ms: int | None
    ended_expires_at: datetime | None
    ended_by: str | None
    principal: str
    key: str | None
    fingerprint: bytes
    status_code: int
    response: dict[str, Any]


def _json(value: Any) -> str:
    """Compact JSON from pydantic-core's encoder: about six times as fast as ``json.dumps`` on these small
    documents (0.4 against 2.7 µs here), and PostgreSQL normalizes jsonb anyway."""
    return to_json(value).decode()


def _parameters(plan: AppendPlan) -> _Parameters:
    """The plan's parameters, its JSON documents still as dicts: the single statement sends each as text,
    a batch sends them inside its one JSON document."""
    granting = plan.events[-1].type in GRANTING_EVENTS
    payloads = []
    for index, event in enumerate(plan.events):
        payload = event_payload(event)
        if granting and index == len(plan.events) - 1:
            del payload["expires_at"]  # stamped by the statement from its own clock
        payloads.append(payload)
    new = plan.new_state
    return _Parameters(
        resource=new.resource,
        expected_version=plan.expected_version,
        require_live=plan.require_live,
        grant_ttl_ms=new.ttl_ms if granting else None,
        event_types=[event.type for event in plan.events],
        event_data=payloads,
        metadata=plan.metadata,
        status=new.status,
        owner=new.owner,
        fencing_token=new.fencing_token,
        ttl_ms=new.ttl_ms,
        ended_expires_at=None if granting else new.expires_at,
        ended_by=new.ended_by,
        principal=plan.idempotency.principal,
        key=plan.idempotency.key,
        fingerprint=plan.idempotency.fingerprint,
        status_code=plan.status_code,
        response=plan.response,
    )


async def commit(conn: Connection, plan: AppendPlan) -> Committed | None:
    """Append the plan in one statement; ``None`` when the stream moved on (decide again)."""
    sql = COMMIT_NEW_SQL if plan.expected_version == 0 else COMMIT_EXISTING_SQL
    p = _parameters(plan)
    row = await conn.fetchrow(
        sql, p.resource, p.expected_version, p.require_live, p.grant_ttl_ms, p.event_types,
        [_json(data) for data in p.event_data], _json(p.metadata), p.status, p.owner, p.fencing_token,
        p.ttl_ms, p.ended_expires_at, p.ended_by, p.principal, p.key, p.fingerprint, p.status_code,
        _json(p.response), new_event_ids(len(p.event_types)),
    )  # fmt: skip
    return None if row is None else Committed(row["response"], row["expires_at"])


# Many plans, on distinct resources and keys, in one statement and so one transaction (and one WAL
# flush). Each plan stands or falls on its own exactly as in the single statement: its head row must be
# at the expected version (locked in resource order, so concurrent batches cannot deadlock on heads),
# the clock is read after every head is locked, and a renew or release needs its lease live at that
# instant. Plans that fail those checks write nothing and come back without a row.
#
# The plans travel as two JSON documents (a row per plan, a row per event), not as an array per column:
# one call of pydantic-core's encoder instead of asyncpg checking every element of 22 arrays against
# collections.abc, and each event's data, metadata and response nested in place rather than encoded one
# by one. That moves about a third of a batch's CPU in the server to PostgreSQL's JSON parser, which
# costs it less than it saves the server (docs/performance.md, "What was changed").
#
# Plans that stay index probes: the batch statements touch lock_state, events and idempotency_keys only
# by key, through a LATERAL lookup per command (not a join the planner may turn into a hash join) and
# ON CONFLICT on the primary key (not UPDATE ... FROM). asyncpg prepares a statement once per connection
# and PostgreSQL caches its plan; a server that starts on an empty database plans while the tables are
# empty and never analyzed, and a join against a table it takes for ten pages looks cheaper as a
# sequential scan. That plan stayed while the table grew: every batch read the whole of lock_state. (A
# table analyzed while it held a page tempts even a per-key lookup into a scan; the command path's
# sessions refuse those: COMMAND_PATH_SETTINGS in service/database.py.)
# tests/storage/test_statement_plans.py plans each statement on such tables and refuses any scan.
COMMIT_MANY_SQL = f"""
WITH c AS (
    SELECT * FROM json_to_recordset($1::json)
        AS c(cmd bigint, resource text, expected bigint, require_live boolean, grant_ttl integer,
             n_events integer, status text, owner text, token bigint, ttl integer,
             ended_expires_at timestamptz, ended_by text, principal text, key text, fingerprint text,
             status_code smallint, response jsonb, metadata jsonb, acquires boolean)
),
head AS (
    SELECT existing.cmd, s.held_until
      FROM (SELECT cmd, resource, expected FROM c WHERE expected > 0 ORDER BY resource) AS existing
     CROSS JOIN LATERAL (
           SELECT expires_at AS held_until FROM lock_state
            WHERE resource = existing.resource AND version = existing.expected
              FOR UPDATE
           ) AS s
),
clock AS (
    SELECT clock_timestamp() AS ts FROM (SELECT count(*) FROM head) AS every_head_locked
),
fresh AS (
    INSERT INTO lock_state (resource, version, status, owner, fencing_token, ttl_ms, expires_at,
                            ended_by, acquired_at, updated_at)
    SELECT c.resource, c.n_events, c.status, c.owner, c.token, c.ttl,
           CASE WHEN c.grant_ttl IS NULL THEN c.ended_expires_at
                ELSE clock.ts + c.grant_ttl * interval '1 millisecond' END,
           c.ended_by, CASE WHEN c.acquires THEN clock.ts END, clock.ts
      FROM c, clock
     WHERE c.expected = 0 AND NOT c.require_live
     ORDER BY c.resource
        ON CONFLICT (resource) DO NOTHING
 RETURNING resource
),
ok AS (
    SELECT c.*, clock.ts,
           CASE WHEN c.grant_ttl IS NULL THEN c.ended_expires_at
                ELSE clock.ts + c.grant_ttl * interval '1 millisecond' END AS new_expires_at
      FROM c JOIN head USING (cmd) CROSS JOIN clock
     WHERE NOT c.require_live OR clock.ts < head.held_until
    UNION ALL
    SELECT c.*, clock.ts,
           CASE WHEN c.grant_ttl IS NULL THEN c.ended_expires_at
                ELSE clock.ts + c.grant_ttl * interval '1 millisecond' END AS new_expires_at
      FROM c JOIN fresh USING (resource) CROSS JOIN clock
),
projected AS (
    INSERT INTO lock_state AS s (resource, version, status, owner, fencing_token, ttl_ms, expires_at,
                                 ended_by, acquired_at, updated_at)
    SELECT resource, expected + n_events, status, owner, token, ttl, new_expires_at, ended_by,
           CASE WHEN acquires THEN ts END, ts
      FROM ok
     WHERE expected > 0
     ORDER BY resource
        ON CONFLICT (resource) DO UPDATE
       SET version = excluded.version, status = excluded.status, owner = excluded.owner,
           fencing_token = excluded.fencing_token, ttl_ms = excluded.ttl_ms,
           expires_at = excluded.expires_at, ended_by = excluded.ended_by,
           acquired_at = coalesce(excluded.acquired_at, s.acquired_at), updated_at = excluded.updated_at
 RETURNING 1
),
appended AS (
    INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata, recorded_at)
    SELECT ok.resource, ok.expected + e.ord, e.id, e.type,
           CASE WHEN ok.grant_ttl IS NOT NULL AND e.ord = ok.n_events
                THEN e.data || jsonb_build_object('expires_at', ok.new_expires_at)
                ELSE e.data END,
           ok.metadata, ok.ts
      FROM ok JOIN json_to_recordset($2::json) AS e(cmd bigint, ord bigint, id uuid, type text, data jsonb)
                   ON e.cmd = ok.cmd
     ORDER BY ok.resource, e.ord
 RETURNING 1
),
answered AS (
    SELECT ok.cmd, ok.ts, ok.new_expires_at, ok.principal, ok.key,
           decode(ok.fingerprint, 'hex') AS fingerprint, ok.resource, ok.status_code,
           CASE WHEN ok.grant_ttl IS NULL THEN ok.response
                ELSE ok.response || jsonb_build_object('expires_at', {_answer_text("ok.new_expires_at")})
            END AS body
      FROM ok
),
remembered AS (
    INSERT INTO idempotency_keys (principal, key, fingerprint, resource, status_code, response, created_at)
    SELECT principal, key, fingerprint, resource, status_code, body, ts
      FROM answered
     WHERE key IS NOT NULL
 RETURNING 1
)
SELECT cmd, body::text AS response, new_expires_at AS expires_at FROM answered
"""


async def commit_many(conn: Connection, plans: list[AppendPlan]) -> list[Committed | None]:
    """``commit`` for several plans on distinct resources and keys, in one statement.

    Any error (a key or stream taken concurrently, a deadlock with another writer) fails the whole
    statement, which then wrote nothing: the caller retries the plans one by one.
    """
    if not plans:
        return []
    commands: list[dict[str, Any]] = []  # an object per plan: a row of COMMIT_MANY_SQL's c
    events: list[dict[str, Any]] = []  # an object per event: a row of its e
    ids = iter(new_event_ids(sum(len(plan.events) for plan in plans)))
    for number, plan in enumerate(plans, start=1):
        p = _parameters(plan)
        commands.append({
            "cmd": number, "resource": p.resource, "expected": p.expected_version,
            "require_live": p.require_live, "grant_ttl": p.grant_ttl_ms, "n_events": len(p.event_types),
            "status": p.status, "owner": p.owner, "token": p.fencing_token, "ttl": p.ttl_ms,
            "ended_expires_at": p.ended_expires_at, "ended_by": p.ended_by, "principal": p.principal,
            "key": p.key, "fingerprint": p.fingerprint.hex(), "status_code": p.status_code,
            "response": p.response, "metadata": p.metadata, "acquires": LOCK_ACQUIRED in p.event_types,
        })  # fmt: skip
        for ordinal, (event_type, data) in enumerate(zip(p.event_types, p.event_data, strict=True), start=1):
            events.append({"cmd": number, "ord": ordinal, "id": next(ids), "type": event_type, "data": data})
    rows = await conn.fetch(COMMIT_MANY_SQL, _json(commands), _json(events))
    by_command = {row["cmd"]: Committed(row["response"], row["expires_at"]) for row in rows}
    return [by_command.get(number) for number in range(1, len(plans) + 1)]
