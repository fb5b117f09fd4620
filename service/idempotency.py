"""Idempotency-Key handling: request fingerprints, replay decisions, and the purge of old keys."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from eventstore.connection import Connection
from service.errors import IdempotencyKeyReused
from service.lock_store import StoredOutcome

MAX_KEY_LENGTH = 255

# Planned afresh at every run (see purge_expired), so written with its two integers in place.
PURGE_SQL = """
DELETE FROM idempotency_keys
 WHERE ctid = ANY(ARRAY(
       SELECT ctid FROM idempotency_keys
        WHERE created_at < clock_timestamp() - {retention_s:d} * interval '1 second'
        ORDER BY created_at
        LIMIT {batch:d}))
"""


# One encoder for every fingerprint (json.dumps builds a new one per call when given options); its output
# must never change, or a retry across an upgrade would no longer match its stored key.
_canonical_json = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


def fingerprint(command: str, resource: str, fields: dict[str, Any]) -> bytes:
    """A digest of the request as decided, so an omitted default and the same value spelled out match."""
    canonical = _canonical_json([command, resource, fields])
    return hashlib.sha256(canonical.encode()).digest()


def replay(stored: StoredOutcome, request_fingerprint: bytes) -> str:
    """The stored answer (JSON) for the same request; a different request under the same key is refused."""
    if stored.fingerprint != request_fingerprint:
        raise IdempotencyKeyReused("this Idempotency-Key was already used for a different request")
    return stored.response


async def purge_expired(conn: Connection, retention_s: int, batch: int) -> int:
    """Delete up to ``batch`` keys older than the retention window; returns how many went.

    Sent as a simple query, never prepared, so PostgreSQL plans it for the table as it is now. A plan
    cached on a new database, while the table was empty, joined the old keys against a sequential scan
    of the whole table (cheapest for ten pages), and would have kept doing so once the table held a
    day of keys; planned afresh, a large table is probed by the old keys' row addresses. It runs every
    few seconds at most, so planning it costs nothing that matters.
    """
    status = await conn.execute(PURGE_SQL.format(retention_s=int(retention_s), batch=int(batch)))
    return int(status.split()[-1])
