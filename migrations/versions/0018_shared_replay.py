"""Shared-lock grants in replay (docs/decisions/0052-shared-locks-in-replay.md).

- ``holding_periods.mode`` and ``lock_limit``: a shared-lock grant's mode and its lock's limit (null on
  mutex rows). A shared grant's rows keep its stream id (``shared/<resource>``) as their resource, so the
  key and indexes of the mutex rows are unchanged. Rows for the shared grants already in the log are
  written here as the projector's build writes them; the projector carries on from its checkpoint.
- ``events_shared_span_idx``: the span each shared grant event keeps its grant for (GiST), and
  ``events_shared_grant_idx``: a shared lock's events by grant token, then version (the grant's acquire,
  and the event after a renewal), for replay's log path and the projector. Partial, on shared events
  only: the mutex's indexes and plans do not change.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SHARED_GRANTS = "'SHARED_ACQUIRED', 'SHARED_RENEWED'"
SHARED_EVENTS = "'SHARED_ACQUIRED', 'SHARED_EXPIRED', 'SHARED_RELEASED', 'SHARED_RENEWED'"
TOKEN = "((data ->> 'fencing_token')::bigint)"

FILL = f"""
INSERT INTO holding_periods (resource, grant_version, owner, fencing_token, acquired_at, saga_id, saga_step,
                             reservation_id, granted_at, expires_at, ended_at, ended_by, mode, lock_limit)
SELECT g.stream_id, g.stream_version, g.data ->> 'owner', g.fencing_token,
       a.recorded_at, a.metadata ->> 'saga_id', a.metadata ->> 'saga_step', a.metadata ->> 'reservation_id',
       g.recorded_at, (g.data ->> 'expires_at')::timestamptz, g.next_at, g.next_type,
       a.data ->> 'mode', (a.data ->> 'limit')::integer
  FROM (SELECT stream_id, stream_version, event_type, data, recorded_at, {TOKEN} AS fencing_token,
               lead(recorded_at) OVER w AS next_at, lead(event_type) OVER w AS next_type
          FROM events WHERE event_type IN ({SHARED_EVENTS})
        WINDOW w AS (PARTITION BY stream_id, {TOKEN} ORDER BY stream_version)) AS g
  LEFT JOIN (SELECT stream_id, recorded_at, metadata, data, {TOKEN} AS fencing_token
               FROM events WHERE event_type = 'SHARED_ACQUIRED') AS a USING (stream_id, fencing_token)
 WHERE g.event_type IN ({SHARED_GRANTS})
 ORDER BY g.recorded_at
    ON CONFLICT (resource, grant_version) DO NOTHING
"""


def upgrade() -> None:
    op.add_column("holding_periods", sa.Column("mode", sa.Text(), nullable=True))
    op.add_column("holding_periods", sa.Column("lock_limit", sa.Integer(), nullable=True))
    op.execute(
        "CREATE INDEX events_shared_span_idx ON events USING gist"
        f" (tstzrange(recorded_at, event_deadline(data))) WHERE event_type IN ({SHARED_GRANTS})"
    )
    op.execute(
        f"CREATE INDEX events_shared_grant_idx ON events (stream_id, {TOKEN}, stream_version)"
        f" WHERE event_type IN ({SHARED_EVENTS})"
    )
    op.execute(FILL)


def downgrade() -> None:
    op.execute("DROP INDEX events_shared_grant_idx")
    op.execute("DROP INDEX events_shared_span_idx")
    op.execute("DELETE FROM holding_periods WHERE starts_with(resource, 'shared/')")
    op.drop_column("holding_periods", "lock_limit")
    op.drop_column("holding_periods", "mode")
