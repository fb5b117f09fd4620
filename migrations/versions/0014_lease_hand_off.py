"""Hand-off of a live lease (docs/decisions/0047-lease-hand-off.md).

- ``lock_state.handed_off_by``: the giver of a hand-off its receiver has not yet accepted or declined.
- Replay's partial indexes on the log take ``LOCK_HANDED_OFF`` in: it is a grant (its span, in
  ``events_lease_span_idx``) and it begins a lease (found by token, in ``events_lease_start_idx``).
- ``events_from_owner_idx``: an agent's history shows the hand-offs it gave, which name it in
  ``from_owner`` (the receiver is the event's ``owner``, in ``events_owner_idx``).

The two replay indexes are dropped and built again on every partition: a log without hand-offs has the
same entries in them, so answers do not change, but the build reads each partition once.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-08
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SPAN = "tstzrange(recorded_at, event_deadline(data))"
LEASE_START = "stream_id, ((data ->> 'fencing_token')::bigint)"


def _replay_indexes(grants: str, starts: str) -> None:
    op.execute("DROP INDEX events_lease_span_idx")
    op.execute(
        f"CREATE INDEX events_lease_span_idx ON events USING gist ({SPAN}) WHERE event_type IN ({grants})"
    )
    op.execute("DROP INDEX events_lease_start_idx")
    op.execute(
        f"CREATE INDEX events_lease_start_idx ON events ({LEASE_START}) WHERE event_type IN ({starts})"
    )


def upgrade() -> None:
    op.add_column("lock_state", sa.Column("handed_off_by", sa.Text(), nullable=True))
    _replay_indexes(
        "'LOCK_ACQUIRED', 'LOCK_HANDED_OFF', 'LOCK_RENEWED'", "'LOCK_ACQUIRED', 'LOCK_HANDED_OFF'"
    )
    op.execute(
        "CREATE INDEX events_from_owner_idx ON events ((data ->> 'from_owner'), position)"
        " WHERE event_type = 'LOCK_HANDED_OFF'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX events_from_owner_idx")
    _replay_indexes("'LOCK_ACQUIRED', 'LOCK_RENEWED'", "'LOCK_ACQUIRED'")
    op.drop_column("lock_state", "handed_off_by")
