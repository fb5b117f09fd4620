"""The reservation a lease was taken in, on lock_state and holding_periods (decision 0048).

``reservation_id`` comes from the metadata of the grant that began the lease (a reserve's
``LOCK_ACQUIRED``), as ``saga_id`` does (migration 0006): ``GET /v1/locks`` and replay's rows name the
reservation without reading the log. Existing rows are filled from the lease's start, found by its
fencing token (``events_lease_start_idx``), as rebuild and the projector fill them: one index probe per
row, and only rows whose lease began in a reservation change. The grants of migrations 0001 and 0012
cover the new columns.

Revision ID: 0017
Revises: 0015 (the merge chains it after 0016)
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STARTS = "'LOCK_ACQUIRED', 'LOCK_HANDED_OFF'"


def _fill(table: str, key: list[str]) -> None:
    """Set ``reservation_id`` on the rows of ``table`` (primary key ``key``) whose lease's start named one."""
    same_row = " AND ".join(f"a.{column} = t.{column}" for column in key)
    op.execute(
        f"""
        UPDATE {table} AS t SET reservation_id = a.reservation_id
          FROM (SELECT {", ".join(f"r.{column}" for column in key)}, (
                       SELECT e.metadata ->> 'reservation_id' FROM events e
                        WHERE e.stream_id = r.resource AND e.event_type IN ({STARTS})
                          AND (e.data ->> 'fencing_token')::bigint = r.fencing_token
                        LIMIT 1) AS reservation_id
                  FROM {table} r) AS a
         WHERE {same_row} AND a.reservation_id IS NOT NULL"""
    )


def upgrade() -> None:
    op.add_column("lock_state", sa.Column("reservation_id", sa.Text(), nullable=True))
    op.add_column("holding_periods", sa.Column("reservation_id", sa.Text(), nullable=True))
    _fill("lock_state", ["resource"])
    _fill("holding_periods", ["resource", "grant_version"])


def downgrade() -> None:
    op.drop_column("holding_periods", "reservation_id")
    op.drop_column("lock_state", "reservation_id")
