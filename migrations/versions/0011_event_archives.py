"""The archive catalog: each partition of the log archived to a file, with the file's digest.

``lockledger archive`` (eventstore/archive.py) records a row here in the transaction that drops the
partition; ``lockledger restore`` marks it restored. Replay answers 410 for instants it covers, naming
the file; ``lockledger verify --archives`` checks each file's digest against the one recorded here.
The service and read-only roles read it; only the migrator writes it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATOR_ROLE = "lockledger_migrator"
SERVICE_ROLE = "lockledger_service"
READONLY_ROLE = "lockledger_readonly"


def upgrade() -> None:
    op.create_table(
        "event_archives",
        sa.Column("partition", sa.Text(), nullable=False),
        sa.Column("lower_bound", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("upper_bound", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("file_name", sa.Text(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("first_position", sa.BigInteger(), nullable=True),
        sa.Column("last_position", sa.BigInteger(), nullable=True),
        sa.Column("content_sha256", sa.Text(), nullable=False),
        sa.Column("archived_at", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("restored_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("partition"),
    )
    op.execute(f"GRANT SELECT ON event_archives TO {SERVICE_ROLE}, {READONLY_ROLE}")
    op.execute(f"ALTER TABLE event_archives OWNER TO {MIGRATOR_ROLE}")


def downgrade() -> None:
    op.drop_table("event_archives")
