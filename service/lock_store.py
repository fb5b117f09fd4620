"""The lock stream's unit of work, in two database round trips per command (one when the service decides
on a state it remembers, ``service/state_cache.py``: then only the commit).

1. ``load_many``: one statement reads, for each command, the stream head (the ``lock_state`` row), the
   database clock, any stored outcome of the request's Idempotency-Key and the first live ticket of the
   lock's queue (an index probe that finds nothing while nobody waits).
2. ``commit_many``: one statement, hence one short transaction, that for each plan
   - locks the stream head and checks the expected version (the serialization point of the resource),
   - reads ``clock_timestamp()`` *after* every head is locked and re-checks that a renewed or released
     lease is still live at that instant,
   - appends the events (``eventstore/append.py``; stream version = expected + n, hash chain by trigger),
   - refuses a grant while a live ticket of the lock's queue precedes the plan's own (``lock_queue_ahead``,
     a fresh snapshot taken after the head is locked: docs/decisions/0049-fair-queues.md), and removes
     the ticket of a grant,
   - writes the inline ``lock_state`` projection (``projections/lock_state.py``),
   - records the Idempotency-Key with the exact response body,
   and returns that body, and for a plan that frees the lock whether acquires queue for it (then the
   caller wakes them). A plan whose version moved or whose lease lapsed meanwhile writes nothing and
   gets no row: the caller loads again and decides again.

A single command is a batch of one: ``load`` and ``commit`` send the same statements. The SQL is
hand-written rather than built with SQLAlchemy because it is the hot path: one prepared statement per
shape, cached by asyncpg. The tables it touches are defined in ``*/schema.py``.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from pydantic_core import to_json

from domain.events import DEADLINE_FIELD, GRANTING_EVENTS, LEASE_STARTS, LOCK_ACQUIRED, event_payload
from domain.queue import Ticket
from eventstore.append import append_sql, event_rows
from eventstore.connection import Connection
from eventstore.payloads import deadline_sql, timestamp_text_sql
from projections.lock_state import (
    advance_heads_sql,
    create_heads_sql,
    live_sql,
    lock_heads_sql,
    read_head_sql,
)
from projections.schema import lock_state_from_row
from service.ports import AppendPlan, Committed, Snapshot, StoredOutcome

# The read for every command waiting to load, in one round trip. Each row is looked up by key (LATERAL),
# never joined: see "Plans that stay index probes" above COMMIT_SQL.
LOAD_SQL = f"""
SELECT q.ord, clock_timestamp() AS db_now,
       s.version, s.status, s.owner, s.fencing_token, s.ttl_ms, s.expires_at, s.ended_by, s.handed_off_by,
       k.fingerprint, k.response::text AS response,
       w.ticket AS queue_ticket, w.owner AS queue_owner, w.deadline AS queue_deadline
  FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS q(resource, principal, key, ord)
  LEFT JOIN LATERAL ({read_head_sql("q.resource")}
       ) AS s ON true
  LEFT JOIN LATERAL (
        SELECT fingerprint, response
          FROM idempotency_keys WHERE principal = q.principal AND key = q.key
         LIMIT 1
       ) AS k ON true
  LEFT JOIN LATERAL (
        SELECT ticket, owner, deadline
          FROM lock_queue WHERE resource = q.resource AND deadline > clock_timestamp()
         ORDER BY ticket
         LIMIT 1
       ) AS w ON true
 ORDER BY q.ord
"""


async def load_many(conn: Connection, requests: list[tuple[str, str, str | None]]) -> list[Snapshot]:
    """The stream head, the clock and the key's stored outcome for each (resource, principal, key), in
    request order (one command is a batch of one)."""
    rows = await conn.fetch(
        LOAD_SQL, [r[0] for r in requests], [r[1] for r in requests], [r[2] for r in requests]
    )
    return [_snapshot(request[0], row) for request, row in zip(requests, rows, strict=True)]


def _snapshot(resource: str, row: asyncpg.Record) -> Snapshot:
    state = lock_state_from_row(resource, row)
    stored = None
    if row["fingerprint"] is not None:
        stored = StoredOutcome(bytes(row["fingerprint"]), row["response"])
    head = None
    if row["queue_ticket"] is not None:
        head = Ticket(row["queue_ticket"], row["queue_owner"], row["queue_deadline"])
    return Snapshot(db_now=row["db_now"], state=state, stored=stored, queue_head=head)


# Plans on distinct resources and keys in one statement and so one transaction (and one WAL flush). Each
# plan stands or falls on its own: its head row must be at the expected version (locked in resource
# order, so concurrent batches cannot deadlock on heads), the clock is read once every head is locked,
# and a renew or release needs its lease live at that instant. Plans that fail those checks write
# nothing and come back without a row. A granted lease's deadline is that instant plus the TTL,
# computed once (``planned``) and written to the head, the event and the answer alike.
#
# The plans travel as two JSON documents (a row per plan, a row per event), not as an array per column:
# one call of pydantic-core's encoder instead of asyncpg checking every element of many arrays, and each
# event's data, metadata and response nested in place rather than encoded one by one.
#
# Plans that stay index probes: the statement touches lock_state, events and idempotency_keys only by
# key, through a LATERAL lookup per command (not a join the planner may turn into a hash join) and
# ON CONFLICT on the primary key (not UPDATE ... FROM). asyncpg prepares a statement once per connection
# and PostgreSQL caches its plan; a server that starts on an empty database plans while the tables are
# empty and never analyzed, and a join against a table it takes for ten pages looks cheaper as a
# sequential scan, a plan that would stay as the table grew. (A table analyzed while it held a page
# tempts even a per-key lookup into a scan; the command path's sessions refuse those:
# COMMAND_PATH_SETTINGS in service/database.py.) tests/storage/test_statement_plans.py plans the
# statement on such tables and refuses any scan.
# A grant's deadline in the answer stored under its Idempotency-Key, which a replay renders as the first.
_ANSWERED_DEADLINE = timestamp_text_sql("ok.new_expires_at")

COMMIT_SQL = f"""
WITH c AS (
    SELECT * FROM json_to_recordset($1::json)
        AS c(cmd bigint, resource text, expected bigint, require_live boolean, grant_ttl integer,
             n_events integer, status text, owner text, token bigint, ttl integer,
             ended_expires_at timestamptz, ended_by text, principal text, key text, fingerprint text,
             response jsonb, metadata jsonb, acquires boolean, handed_off_by text, takes_free boolean,
             ticket bigint)
),
head AS ({lock_heads_sql("c")}
),
clock AS (
    SELECT clock_timestamp() AS ts FROM (SELECT count(*) FROM head) AS every_head_locked
),
planned AS (
    SELECT c.*, clock.ts,
           CASE WHEN c.grant_ttl IS NULL THEN c.ended_expires_at
                ELSE {deadline_sql("clock.ts", "c.grant_ttl")} END AS new_expires_at
      FROM c CROSS JOIN clock
),
fresh AS ({create_heads_sql("planned")}
),
ok AS (
    SELECT planned.* FROM planned JOIN head USING (cmd)
     WHERE (NOT planned.require_live OR {live_sql("head.held_until", "planned.ts")})
       AND CASE WHEN planned.takes_free
                THEN NOT lock_queue_ahead(planned.resource, planned.ticket, planned.ts) ELSE true END
    UNION ALL
    SELECT planned.* FROM planned JOIN fresh USING (resource)
),
projected AS ({advance_heads_sql("ok")}
),
appended AS ({append_sql("ok", "$2::json")}
),
dequeued AS (
    DELETE FROM lock_queue WHERE ticket = ANY(ARRAY(SELECT ok.ticket FROM ok WHERE ok.ticket IS NOT NULL))
),
answered AS (
    SELECT ok.cmd, ok.ts, ok.new_expires_at, ok.principal, ok.key,
           decode(ok.fingerprint, 'hex') AS fingerprint, ok.resource,
           CASE WHEN ok.grant_ttl IS NULL THEN ok.response
                ELSE ok.response || jsonb_build_object('{DEADLINE_FIELD}', {_ANSWERED_DEADLINE})
            END AS body,
           CASE WHEN ok.status = 'free' THEN lock_queue_ahead(ok.resource, NULL, ok.ts)
                ELSE false END AS queued
      FROM ok
),
remembered AS (
    INSERT INTO idempotency_keys (principal, key, fingerprint, resource, response, created_at)
    SELECT principal, key, fingerprint, resource, body, ts
      FROM answered
     WHERE key IS NOT NULL
 RETURNING 1
)
SELECT cmd, new_expires_at AS expires_at, queued FROM answered
"""


def _json(value: Any) -> str:
    """Compact JSON from pydantic-core's encoder: several times as fast as ``json.dumps`` on these small
    documents, and PostgreSQL normalizes jsonb anyway."""
    return to_json(value).decode()


async def commit_many(conn: Connection, plans: list[AppendPlan]) -> list[Committed | None]:
    """Append plans on distinct resources and keys in one statement; ``None`` for each plan whose stream
    moved on or whose lease lapsed.

    Any error (a key or stream taken concurrently, a deadlock with another writer) fails the whole
    statement, which then wrote nothing: the caller retries the plans one by one.
    """
    if not plans:
        return []
    commands: list[dict[str, Any]] = []  # an object per plan: a row of COMMIT_SQL's c
    events: list[list[tuple[str, dict[str, Any]]]] = []  # per plan, (type, payload) per event
    for number, plan in enumerate(plans, start=1):
        commands.append(_command_row(number, plan))
        events.append(_event_payloads(plan))
    rows = await conn.fetch(COMMIT_SQL, _json(commands), _json(event_rows(events)))
    by_command = {row["cmd"]: Committed(row["expires_at"], row["queued"]) for row in rows}
    return [by_command.get(number) for number in range(1, len(plans) + 1)]


def _event_payloads(plan: AppendPlan) -> list[tuple[str, dict[str, Any]]]:
    """Each event's type and payload (a grant's without a deadline: the statement stamps it)."""
    return [(event.type, event_payload(event)) for event in plan.events]


def _command_row(number: int, plan: AppendPlan) -> dict[str, Any]:
    new = plan.new_state
    granting = plan.events[-1].type in GRANTING_EVENTS
    return {
        "cmd": number, "resource": new.resource, "expected": plan.expected_version,
        "require_live": plan.require_live, "grant_ttl": new.ttl_ms if granting else None,
        "n_events": len(plan.events), "status": new.status, "owner": new.owner,
        "token": new.fencing_token, "ttl": new.ttl_ms,
        "ended_expires_at": None if granting else new.expires_at, "ended_by": new.ended_by,
        "principal": plan.idempotency.principal, "key": plan.idempotency.key,
        "fingerprint": plan.idempotency.fingerprint.hex(),
        "response": plan.response, "metadata": plan.metadata,
        "acquires": any(event.type in LEASE_STARTS for event in plan.events),
        "handed_off_by": new.handed_off_by,
        # Only a free lock's taking waits its turn in the queue: a hand-off passes a held one on.
        "takes_free": any(event.type == LOCK_ACQUIRED for event in plan.events),
        "ticket": plan.ticket,
    }  # fmt: skip
