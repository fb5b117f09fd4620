"""Asynchronous projectors: their checkpoints, holding_periods for replay, agent_stats for the dashboard.

Both tables start empty with their checkpoints at the start of the log: the server's projector runner
fills them from the log (``service/projectors.py``), and replay reads the log until holding_periods has
caught up (``projections/replay.py``). The service role writes the tables; the read-only role reads them.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SERVICE_ROLE = "lockledger_service"
READONLY_ROLE = "lockledger_readonly"
MIGRATOR_ROLE = "lockledger_migrator"
VALIDITY = "tstzrange(granted_at, greatest(granted_at, least(expires_at, ended_at)))"
TIMESTAMPTZ = postgresql.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.create_table(
        "projector_checkpoints",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("lo", sa.BigInteger(), nullable=False),
        sa.Column("hi", sa.BigInteger(), nullable=False),
        sa.Column("after", sa.BigInteger(), nullable=False),
        sa.Column("covered_until", TIMESTAMPTZ, nullable=True),
        sa.Column("updated_at", TIMESTAMPTZ, nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "holding_periods",
        sa.Column("resource", sa.Text(), nullable=False),
        sa.Column("grant_version", sa.BigInteger(), nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", TIMESTAMPTZ, nullable=True),
        sa.Column("saga_id", sa.Text(), nullable=True),
        sa.Column("saga_step", sa.Text(), nullable=True),
        sa.Column("granted_at", TIMESTAMPTZ, nullable=False),
        sa.Column("expires_at", TIMESTAMPTZ, nullable=False),
        sa.Column("ended_at", TIMESTAMPTZ, nullable=True),
        sa.Column("ended_by", sa.Text(), nullable=True),
        sa.Column("valid", postgresql.TSTZRANGE(), sa.Computed(VALIDITY, persisted=True), nullable=False),
        sa.PrimaryKeyConstraint("resource", "grant_version"),
    )
    op.create_index("holding_periods_valid_idx", "holding_periods", ["valid"], postgresql_using="gist")
    op.create_table(
        "agent_stats",
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("zone", sa.Text(), nullable=False),
        sa.Column("holds", sa.BigInteger(), nullable=False),
        sa.Column("ended", sa.BigInteger(), nullable=False),
        sa.Column("held_ms", sa.BigInteger(), nullable=False),
        sa.Column("lapses", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("owner", "zone"),
    )
    op.execute(
        "INSERT INTO projector_checkpoints (name, lo, hi, after, updated_at)"
        " VALUES ('holding_periods', 1, 1, 0, clock_timestamp()), ('agent_stats', 1, 1, 0, clock_timestamp())"
    )
    for table in ("projector_checkpoints", "holding_periods", "agent_stats"):
        op.execute(f"GRANT SELECT, INSERT, UPDATE ON {table} TO {SERVICE_ROLE}")
        op.execute(f"GRANT SELECT ON {table} TO {READONLY_ROLE}")
        op.execute(f"ALTER TABLE {table} OWNER TO {MIGRATOR_ROLE}")


def downgrade() -> None:
    op.drop_table("agent_stats")
    op.drop_table("holding_periods")
    op.drop_table("projector_checkpoints")
