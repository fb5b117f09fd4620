"""Sagas: the saga_state projection, and the saga a lease was acquired in on lock_state.

A saga's events are the stream ``saga:<id>`` in the events table (no change there); saga_state is its
inline projection and stream head, like lock_state for a lock. ``lock_state.saga_id`` and ``saga_step``
come from the metadata of the acquire that began the lease (``X-Saga-ID``, ``X-Saga-Step``). The service
role may read and write saga_state (never delete), the read-only role may read it, and the migrator owns
it, as every table (migration 0003).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATOR_ROLE = "lockledger_migrator"
SERVICE_ROLE = "lockledger_service"
READONLY_ROLE = "lockledger_readonly"


def upgrade() -> None:
    op.add_column("lock_state", sa.Column("saga_id", sa.Text(), nullable=True))
    op.add_column("lock_state", sa.Column("saga_step", sa.Text(), nullable=True))
    op.create_table(
        "saga_state",
        sa.Column("saga_id", sa.Text(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("policy", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("steps", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("started_at", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("updated_at", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('running', 'compensating', 'completed', 'aborted', 'stuck')",
            name="saga_state_status_check",
        ),
        sa.CheckConstraint("policy IN ('compensate', 'forward')", name="saga_state_policy_check"),
        sa.PrimaryKeyConstraint("saga_id"),
    )
    op.create_index("saga_state_status_idx", "saga_state", ["status", "saga_id"])
    op.create_index("saga_state_owner_idx", "saga_state", ["owner", "saga_id"])
    op.create_index("saga_state_name_idx", "saga_state", ["name", "saga_id"])
    op.execute(f"GRANT SELECT, INSERT, UPDATE ON saga_state TO {SERVICE_ROLE}")
    op.execute(f"GRANT SELECT ON saga_state TO {READONLY_ROLE}")
    op.execute(f"ALTER TABLE saga_state OWNER TO {MIGRATOR_ROLE}")


def downgrade() -> None:
    op.drop_table("saga_state")
    op.drop_column("lock_state", "saga_step")
    op.drop_column("lock_state", "saga_id")
