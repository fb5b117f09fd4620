"""Appending to the log: the one INSERT into ``events``, and the rows it takes.

The append runs as a part of the command statement (``service/lock_store.py``), in the same transaction
as the projection and the Idempotency-Key, after the stream heads are locked and the clock is read. It
takes the events as one JSON document (``event_rows``: a row per event, ids made here,
``eventstore/event_ids.py``) and each plan's stream, expected version, metadata and clock from the
relation of plans that passed their checks. The hash chain and the version-gap check are the trigger's.
"""

from __future__ import annotations

from typing import Any

from eventstore.event_ids import new_event_ids
from eventstore.payloads import stamp_deadline_sql


def event_rows(plans: list[list[tuple[str, dict[str, Any]]]]) -> list[dict[str, Any]]:
    """A row per event of each plan (its (type, payload) pairs), numbered by plan (from 1) and by
    ordinal within it (from 1), each with a new event id: the document :func:`append_sql` reads."""
    ids = iter(new_event_ids(sum(len(events) for events in plans)))
    return [
        {"cmd": number, "ord": ordinal, "id": next(ids), "type": event_type, "data": data}
        for number, events in enumerate(plans, start=1)
        for ordinal, (event_type, data) in enumerate(events, start=1)
    ]


def append_sql(ok: str, rows: str) -> str:
    """Append the events of every plan in ``ok`` (columns cmd, resource, expected, n_events, grant_ttl,
    new_expires_at, metadata, ts) from ``rows`` (a json expression: :func:`event_rows`) at stream versions
    expected + ordinal; a plan that grants a lease gets its deadline stamped into its last event."""
    return f"""
    INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata, recorded_at)
    SELECT ok.resource, ok.expected + e.ord, e.id, e.type,
           CASE WHEN ok.grant_ttl IS NOT NULL AND e.ord = ok.n_events
                THEN {stamp_deadline_sql("e.data", "ok.new_expires_at")}
                ELSE e.data END,
           ok.metadata, ok.ts
      FROM {ok} AS ok
      JOIN json_to_recordset({rows}) AS e(cmd bigint, ord bigint, id uuid, type text, data jsonb)
        ON e.cmd = ok.cmd
     ORDER BY ok.resource, e.ord
 RETURNING 1"""
