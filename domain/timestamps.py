"""How an instant is written in every answer: RFC 3339, in UTC, with microseconds and ``Z``.

One shape everywhere (command answers, queries, history, tokens, problem bodies and their details), so a
client can parse and compare timestamps as text without knowing which endpoint sent them. Microseconds
because PostgreSQL's ``timestamptz`` keeps microseconds: the rendering never rounds a lease deadline.
The command statement renders its answers in the database with :data:`SQL_TIMESTAMP_FORMAT`, which must
write exactly what :func:`format_timestamp` writes.
"""

from __future__ import annotations

from datetime import UTC, datetime

TIMESTAMP_PATTERN = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$"

# PostgreSQL's to_char() template for the same shape (of a timestamp already converted to UTC).
SQL_TIMESTAMP_FORMAT = 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'


def format_timestamp(value: datetime) -> str:
    """``2026-05-05T09:30:00.000000Z``: the instant in UTC, always six fractional digits.

    A naive datetime is refused rather than guessed at: every instant here comes from the database
    clock, with its offset.
    """
    offset = value.utcoffset()
    if offset is None:
        raise ValueError(f"a naive datetime has no instant to render: {value!r}")
    if offset:
        value = value.astimezone(UTC)
    return value.isoformat(timespec="microseconds")[:-6] + "Z"  # "+00:00" becomes "Z"
