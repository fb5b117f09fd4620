"""Idempotency keys keep the answer's fields, not an HTTP status.

The service returns typed outcomes and ``api/`` alone decides status codes, so a stored answer no longer
needs its status: a replay gets the status its command's endpoint gives.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_column("idempotency_keys", "status_code")


def downgrade() -> None:
    # An acquire's answer was 201 and every other 200; an acquire's fields cannot be told from a renew's,
    # so keys stored since the upgrade replay as 200 after a downgrade.
    op.add_column(
        "idempotency_keys",
        sa.Column("status_code", sa.SmallInteger(), nullable=False, server_default="200"),
    )
    op.alter_column("idempotency_keys", "status_code", server_default=None)
