"""The outage beacon: one row each running instance writes every second (service/outage.py).

A gap in it longer than the service's ``outage_after_ms`` is an outage, after which the first instance
to write it again extends every live lease by the gap. The service role reads and writes it, the
read-only role reads it, the migrator owns it.

Revision ID: 0008
Revises: 0006
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATOR_ROLE = "lockledger_migrator"
SERVICE_ROLE = "lockledger_service"
READONLY_ROLE = "lockledger_readonly"


def upgrade() -> None:
    op.create_table(
        "outage_beacon",
        sa.Column("id", sa.SmallInteger(), nullable=False),
        sa.Column("beat_at", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("beaten_by", sa.Text(), nullable=False),
        sa.CheckConstraint("id = 1", name="outage_beacon_one_row"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.execute(f"GRANT SELECT, INSERT, UPDATE ON outage_beacon TO {SERVICE_ROLE}")
    op.execute(f"GRANT SELECT ON outage_beacon TO {READONLY_ROLE}")
    op.execute(f"ALTER TABLE outage_beacon OWNER TO {MIGRATOR_ROLE}")


def downgrade() -> None:
    op.drop_table("outage_beacon")
