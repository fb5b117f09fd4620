"""The service's own tables.

idempotency_keys: the stored outcome of every command that carried an Idempotency-Key. Written by the same
statement that appends the command's events, so a key exists if and only if its events do; replaying it
never appends again.

api_tokens: who may call the API, and as what role (`lockledger tokens`).

outage_beacon: one row, written every second by each running instance; a gap in it is an outage after
which live leases are extended (service/outage.py).

lock_queue: the tickets of waiting acquires, in arrival order (``ticket``); a ticket stops counting at its
``deadline`` (service/queue_store.py, docs/decisions/0049-fair-queues.md). A shared lock's waiters queue
here too, under its stream id (``shared/<resource>``), each ticket marked ``exclusive`` or not.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Identity,
    Index,
    LargeBinary,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP

from eventstore.schema import metadata

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("principal", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("fingerprint", LargeBinary, nullable=False),
    Column("resource", Text, nullable=False),
    Column("response", JSONB, nullable=False),
    Column("created_at", TIMESTAMP(timezone=True), nullable=False),
    PrimaryKeyConstraint("principal", "key", name="idempotency_keys_pkey"),
    Index("idempotency_keys_created_at_idx", "created_at"),
)

api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("name", Text, nullable=False),
    Column("role", Text, nullable=False),
    # SHA-256 of the token: tokens are 256 random bits, so a fast hash is as strong as a slow one, and a
    # leaked table reveals no usable token.
    Column("token_hash", LargeBinary, nullable=False),
    Column("created_at", TIMESTAMP(timezone=True), nullable=False, server_default=func.now()),
    Column("revoked_at", TIMESTAMP(timezone=True)),
    CheckConstraint("role IN ('agent', 'dashboard', 'investigator', 'admin')", name="api_tokens_role_check"),
    Index("api_tokens_token_hash_key", "token_hash", unique=True),
    Index("api_tokens_name_idx", "name"),
    # service/authenticator.py asks every few seconds which tokens were revoked lately.
    Index("api_tokens_revoked_at_idx", "revoked_at", postgresql_where=text("revoked_at IS NOT NULL")),
)

outage_beacon = Table(
    "outage_beacon",
    metadata,
    Column("id", SmallInteger, primary_key=True),
    Column("beat_at", TIMESTAMP(timezone=True), nullable=False),
    Column("beaten_by", Text, nullable=False),
    CheckConstraint("id = 1", name="outage_beacon_one_row"),
)

lock_queue = Table(
    "lock_queue",
    metadata,
    Column("ticket", BigInteger, Identity(always=True), primary_key=True),
    Column("resource", Text, nullable=False),
    Column("owner", Text, nullable=False),
    Column("server", Text, nullable=False),
    Column("since", TIMESTAMP(timezone=True), nullable=False),
    Column("deadline", TIMESTAMP(timezone=True), nullable=False),
    # Whether the ticket waits for an exclusive grant (every mutex ticket does; migration 0016).
    Column("exclusive", Boolean, nullable=False, server_default=text("true")),
    Index("lock_queue_resource_ticket_idx", "resource", "ticket"),
    Index("lock_queue_deadline_idx", "deadline"),
)
