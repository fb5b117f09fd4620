"""Idempotency-Key handling: request fingerprints and replay decisions (the purge of old keys is the
reaper's: ``ReaperStore.purge_keys``, ``service/reaper_store.py``)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from service.errors import IdempotencyKeyReused
from service.ports import StoredOutcome

MAX_KEY_LENGTH = 255

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
