"""lock_state: one row per resource, projected inline in the same statement as the append.

The row is also the stream's head: its ``version`` is the expected version the next append must match,
and ``SELECT ... FOR UPDATE`` on it is where concurrent commands on one resource are serialized.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import BigInteger, CheckConstraint, Column, Index, Integer, Table, Text, text
from sqlalchemy.dialects.postgresql import TIMESTAMP

from domain.state import LockState
from eventstore.schema import metadata
from projections.agent_stats import agent_stats
from projections.checkpoints import projector_checkpoints
from projections.holding_periods import holding_periods
from projections.saga_state import saga_state
from projections.shared_locks import shared_holders, shared_locks

lock_state = Table(
    "lock_state",
    metadata,
    Column("resource", Text, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("status", Text, nullable=False),
    Column("owner", Text),
    Column("fencing_token", BigInteger, nullable=False),
    Column("ttl_ms", Integer),
    Column("expires_at", TIMESTAMP(timezone=True)),
    Column("ended_by", Text),
    Column("acquired_at", TIMESTAMP(timezone=True)),
    Column("updated_at", TIMESTAMP(timezone=True), nullable=False),
    # The saga the lease was acquired in (X-Saga-ID, X-Saga-Step of the acquire), like acquired_at.
    Column("saga_id", Text),
    Column("saga_step", Text),
    # The reservation the lease was taken in (metadata.reservation_id of its grant; migration 0017).
    Column("reservation_id", Text),
    # The giver of a hand-off the holder has not yet accepted or declined (migration 0014).
    Column("handed_off_by", Text),
    CheckConstraint("status IN ('held', 'free')", name="lock_state_status_check"),
    # Dashboards: locks of one agent, leases expiring soon (also the reaper's scan), resources by prefix.
    Index("lock_state_owner_idx", "owner", postgresql_where=text("status = 'held'")),
    Index("lock_state_expires_at_idx", "expires_at", postgresql_where=text("status = 'held'")),
    Index("lock_state_resource_prefix_idx", text("resource text_pattern_ops")),
)


# Registered on the MetaData by import: saga_state, the shared locks' tables and the asynchronous
# projectors' tables.
__all__ = [
    "agent_stats",
    "holding_periods",
    "lock_state",
    "lock_state_from_row",
    "projector_checkpoints",
    "saga_state",
    "shared_holders",
    "shared_locks",
]


class Row(Protocol):
    """A database row read by column name (an asyncpg Record, a dict)."""

    def __getitem__(self, key: str) -> Any: ...


def lock_state_from_row(resource: str, row: Row) -> LockState:
    """The decider's view of a lock_state row (the initial state when the row's columns are NULL)."""
    if row["version"] is None:
        return LockState(resource=resource)
    return LockState(
        resource=resource,
        version=row["version"],
        status=row["status"],
        owner=row["owner"],
        fencing_token=row["fencing_token"],
        ttl_ms=row["ttl_ms"],
        expires_at=row["expires_at"],
        ended_by=row["ended_by"],
        handed_off_by=row["handed_off_by"],
    )
