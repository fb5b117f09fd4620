"""idempotency_keys: the stored outcome of every command that carried an Idempotency-Key.

Written by the same statement that appends the command's events, so a key exists if and only if its
events do; replaying it never appends again.
"""

from __future__ import annotations

from sqlalchemy import Column, Index, LargeBinary, PrimaryKeyConstraint, SmallInteger, Table, Text
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP

from eventstore.schema import metadata

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("principal", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("fingerprint", LargeBinary, nullable=False),
    Column("resource", Text, nullable=False),
    Column("status_code", SmallInteger, nullable=False),
    Column("response", JSONB, nullable=False),
    Column("created_at", TIMESTAMP(timezone=True), nullable=False),
    PrimaryKeyConstraint("principal", "key", name="idempotency_keys_pkey"),
    Index("idempotency_keys_created_at_idx", "created_at"),
)
