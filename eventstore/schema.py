"""The events table: lockledger's one source of truth.

SQLAlchemy Core tables are the schema's single definition; the alembic migrations are derived from them
and ``tests/storage/test_migrations.py`` proves the migrated database matches. What Core cannot express
(append-only triggers, the hash chain, grants) lives in the migration, next to the table it guards.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Identity,
    Index,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP, UUID
from sqlalchemy.types import UserDefinedType

from domain.events import GRANTING_EVENTS, LEASE_STARTS, LOCK_HANDED_OFF
from domain.shared_lock import SHARED_EVENT_TYPES, SHARED_GRANTS

# One MetaData for the whole database; projections and service add their tables to it.
metadata = MetaData()

# The database role the service runs as: INSERT and SELECT on events, nothing that rewrites history.
SERVICE_ROLE = "lockledger_service"


def _names(event_types: frozenset[str]) -> str:
    """SQL's list of ``event_types``, in the order the migrations write them."""
    return ", ".join(f"'{name}'" for name in sorted(event_types))


class Xid8(UserDefinedType[Any]):
    """PostgreSQL's 64-bit transaction id, which never wraps around (PG 13+)."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "xid8"


events = Table(
    "events",
    metadata,
    # Global order of all events. A reader tailing the log pairs it with tx_id (see DESIGN.md).
    Column("position", BigInteger, Identity(always=True), nullable=False),
    Column("stream_id", Text, nullable=False),
    Column("stream_version", BigInteger, nullable=False),
    Column("event_id", UUID(as_uuid=True), nullable=False, server_default=text("gen_random_uuid()")),
    Column("event_type", Text, nullable=False),
    Column("data", JSONB, nullable=False),
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # The database clock at the append; lease deadlines are computed from this same instant.
    Column(
        "recorded_at",
        TIMESTAMP(timezone=True),
        nullable=False,
        server_default=text("clock_timestamp()"),
    ),
    # The writing transaction, so a tailing reader can wait for transactions that are still in flight.
    Column("tx_id", Xid8(), nullable=False, server_default=text("pg_current_xact_id()")),
    # sha256(previous event's hash || this event), set by the events_chain_hash trigger.
    Column("hash", LargeBinary, nullable=False),
    # Range-partitioned by recorded_at (migration 0010; docs/decisions/0044-time-partitioned-events.md).
    # Every unique index of a partitioned table includes the partition key, so the primary key and the
    # event id's are unique per instant; (stream_id, stream_version) is kept unique by stream_heads.
    PrimaryKeyConstraint("position", "recorded_at", name="events_pkey"),
    UniqueConstraint("event_id", "recorded_at", name="events_event_id_key"),
    Index("events_stream_version_idx", "stream_id", "stream_version"),
    Index("events_recorded_at_idx", "recorded_at", postgresql_include=["position"]),
    # Replay (projections/replay.py): the span each grant keeps its lease for, unless ended sooner; one
    # agent's events; the acquire that began a lease. event_deadline() is the migration's (0005).
    Index(
        "events_lease_span_idx",
        text("tstzrange(recorded_at, event_deadline(data))"),
        postgresql_using="gist",
        postgresql_where=text(f"event_type IN ({_names(GRANTING_EVENTS)})"),
    ),
    Index("events_owner_idx", text("(data ->> 'owner')"), "position"),
    Index(
        "events_lease_start_idx",
        "stream_id",
        text("((data ->> 'fencing_token')::bigint)"),
        postgresql_where=text(f"event_type IN ({_names(LEASE_STARTS)})"),
    ),
    # An agent's history: the hand-offs it gave name it in from_owner (migration 0013).
    Index(
        "events_from_owner_idx",
        text("(data ->> 'from_owner')"),
        "position",
        postgresql_where=text(f"event_type = '{LOCK_HANDED_OFF}'"),
    ),
    # Replay of shared locks (migration 0018): each shared grant event's span, and a shared lock's events
    # by grant token then version (a grant's acquire, the event after a renewal).
    Index(
        "events_shared_span_idx",
        text("tstzrange(recorded_at, event_deadline(data))"),
        postgresql_using="gist",
        postgresql_where=text(f"event_type IN ({_names(SHARED_GRANTS)})"),
    ),
    Index(
        "events_shared_grant_idx",
        "stream_id",
        text("((data ->> 'fencing_token')::bigint)"),
        "stream_version",
        postgresql_where=text(f"event_type IN ({_names(SHARED_EVENT_TYPES)})"),
    ),
    postgresql_partition_by="RANGE (recorded_at)",
)

# The head of every stream: its last version and hash, kept by the events_chain_hash trigger. The trigger
# chains a new event to the head's hash and moves the head only from the version before it, so a
# stream's versions stay unique and gapless across partitions with one primary-key probe per event.
stream_heads = Table(
    "stream_heads",
    metadata,
    Column("stream_id", Text, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("hash", LargeBinary, nullable=False),
)

# The archive catalog (migration 0011, eventstore/archive.py): each partition archived to a file.
event_archives = Table(
    "event_archives",
    metadata,
    Column("partition", Text, primary_key=True),
    Column("lower_bound", TIMESTAMP(timezone=True), nullable=False),
    Column("upper_bound", TIMESTAMP(timezone=True), nullable=False),
    Column("file_name", Text, nullable=False),
    Column("events", BigInteger, nullable=False),
    Column("first_position", BigInteger),
    Column("last_position", BigInteger),
    # SHA-256 of the file's uncompressed content before its trailer (eventstore/archive_file.py).
    Column("content_sha256", Text, nullable=False),
    Column("archived_at", TIMESTAMP(timezone=True), nullable=False),
    Column("restored_at", TIMESTAMP(timezone=True)),
)
