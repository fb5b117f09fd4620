"""Saga leases: each saga's lease length, its deadline and its last lapse, on saga_state.

``lease_expires_at`` is stamped by every append of an unfinished saga (the append's clock plus
``lease_ms``) and is NULL once the saga ends, so the reaper's pass (``service/saga_lapse.py``) reads a
partial index of unfinished sagas by deadline. Sagas started before this migration have no lease
(``lease_ms`` NULL) and never lapse; the grants of migration 0006 cover the new columns.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("saga_state", sa.Column("lease_ms", sa.Integer(), nullable=True))
    op.add_column(
        "saga_state", sa.Column("lease_expires_at", postgresql.TIMESTAMP(timezone=True), nullable=True)
    )
    op.add_column(
        "saga_state", sa.Column("lease_lapsed_at", postgresql.TIMESTAMP(timezone=True), nullable=True)
    )
    op.create_index(
        "saga_state_lease_idx",
        "saga_state",
        ["lease_expires_at"],
        postgresql_where=sa.text("lease_expires_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("saga_state_lease_idx", table_name="saga_state")
    op.drop_column("saga_state", "lease_lapsed_at")
    op.drop_column("saga_state", "lease_expires_at")
    op.drop_column("saga_state", "lease_ms")
