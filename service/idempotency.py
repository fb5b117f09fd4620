"""Idempotency-Key handling: request fingerprints, replay decisions, and the purge of old keys."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from eventstore.connection import Connection
from service.errors import IdempotencyKeyReused
from service.lock_store import StoredOutcome

MAX_KEY_LENGTH = 255

PURGE_SQL = """
DELETE FROM idempotency_keys
 WHERE (principal, key) IN (
       SELECT principal, key FROM idempotency_keys
        WHERE created_at < clock_timestamp() - $1::integer * interval '1 second'
        ORDER BY created_at
        LIMIT $2::integer)
"""


# One encoder for every fingerprint (json.dumps builds a new one per call when given options); its output
# must never change, or a retry across an upgrade would no longer match its stored key.
_canonical_json = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


def fingerprint(command: str, resource: str, fields: dict[str, Any]) -> bytes:
    """A digest of the request as decided, so an omitted default and the same value spelled out match."""
    canonical = _canonical_json([command, resource, fields])
    return hashlib.sha256(canonical.encode()).digest()


@dataclass(frozen=True, slots=True)
class Replay:
    status_code: int
    body: str


def replay(stored: StoredOutcome, request_fingerprint: bytes) -> Replay:
    """The stored outcome for the same request; a different request under the same key is refused."""
    if stored.fingerprint != request_fingerprint:
        raise IdempotencyKeyReused("this Idempotency-Key was already used for a different request")
    return Replay(stored.status_code, stored.response)


async def purge_expired(conn: Connection, retention_s: int, batch: int) -> int:
    """Delete up to ``batch`` keys older than the retention window; returns how many went."""
    status = await conn.execute(PURGE_SQL, retention_s, batch)
    return int(status.split()[-1])
