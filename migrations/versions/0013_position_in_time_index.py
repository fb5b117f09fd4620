"""The time index of ``events`` carries each event's position.

Replay's answer at an instant names the last position recorded by then: the largest position among the
events of the minute before it (``projections/replay.py``). With the position in the index that is an
index-only scan of the minute, not a visit to each event's row.

Rebuilding the index blocks appends while it runs; docs/operations.md says how long it takes.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("DROP INDEX events_recorded_at_idx")
    op.execute("CREATE INDEX events_recorded_at_idx ON events (recorded_at) INCLUDE (position)")


def downgrade() -> None:
    op.execute("DROP INDEX events_recorded_at_idx")
    op.execute("CREATE INDEX events_recorded_at_idx ON events (recorded_at)")
