"""Event payloads in SQL, generated from ``domain/events.py``'s field tables.

The statements that write or read a payload in the database (the append's deadline stamp, the reaper's
``LOCK_EXPIRED``, rebuild) take their fragments from here, so they name exactly the fields that
``event_payload`` writes and ``event_from_payload`` reads, with the same types.
"""

from __future__ import annotations

from datetime import datetime

from domain.events import DEADLINE_FIELD, GRANTING_EVENTS, PAYLOAD_FIELDS, PAYLOAD_TYPES
from domain.timestamps import SQL_TIMESTAMP_FORMAT

_SQL_TYPES: dict[type, str] = {str: "text", int: "bigint", datetime: "timestamptz"}


def timestamp_text_sql(instant: str) -> str:
    """SQL writing the timestamptz ``instant`` as ``domain.timestamps.format_timestamp`` does (RFC 3339,
    UTC, microseconds, ``Z``): how the log stores an instant, whichever side writes the event."""
    return f"to_char({instant} AT TIME ZONE 'UTC', '{SQL_TIMESTAMP_FORMAT}')"


def build_payload_sql(event_type: str, **columns: str) -> str:
    """``jsonb_build_object(...)`` of an ``event_type`` payload from SQL expressions, one per field."""
    fields = PAYLOAD_FIELDS[event_type]
    if set(columns) != set(fields):
        raise ValueError(f"{event_type} payloads have the fields {fields}, not {sorted(columns)}")
    values = {
        field: timestamp_text_sql(columns[field]) if PAYLOAD_TYPES[field] is datetime else columns[field]
        for field in fields
    }
    return "jsonb_build_object(" + ", ".join(f"'{field}', {values[field]}" for field in fields) + ")"


def payload_field_sql(data: str, field: str) -> str:
    """One field of the payload ``data`` (a jsonb expression), as its SQL type."""
    return f"({data} ->> '{field}')::{_SQL_TYPES[PAYLOAD_TYPES[field]]}"


def stamp_deadline_sql(data: str, deadline: str) -> str:
    """The payload ``data`` with its lease deadline set to ``deadline`` (a timestamptz expression)."""
    return f"{data} || jsonb_build_object('{DEADLINE_FIELD}', {timestamp_text_sql(deadline)})"


def deadline_sql(at: str, ttl_ms: str) -> str:
    """``domain.events.deadline`` in SQL: the end of a lease of ``ttl_ms`` granted at ``at``."""
    return f"({at} + {ttl_ms} * interval '1 millisecond')"


def is_granting_sql(event_type: str) -> str:
    """Whether ``event_type`` (a text expression) grants a lease: the event types ``GRANTING_EVENTS``."""
    return f"{event_type} IN ({', '.join(repr(name) for name in sorted(GRANTING_EVENTS))})"
