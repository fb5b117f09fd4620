"""Indexes over the log for replay: leases live at an instant, one agent's events, a lease's start.

Replay reads only the events table; these indexes are derived from it (``lockledger rebuild`` rebuilds
them). ``event_deadline(data)`` reads a grant's deadline from its payload, where the append wrote it with
its UTC offset, so the reading never depends on the session's time zone: that is why it may be declared
IMMUTABLE, which an index expression needs.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATOR_ROLE = "lockledger_migrator"

EVENT_DEADLINE = """
CREATE FUNCTION event_deadline(data jsonb) RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT (data ->> 'expires_at')::timestamptz $$"""


def upgrade() -> None:
    op.execute(EVENT_DEADLINE)
    op.execute(f"ALTER FUNCTION event_deadline(jsonb) OWNER TO {MIGRATOR_ROLE}")
    op.execute(
        "CREATE INDEX events_lease_span_idx ON events USING gist"
        " (tstzrange(recorded_at, event_deadline(data)))"
        " WHERE event_type IN ('LOCK_ACQUIRED', 'LOCK_RENEWED')"
    )
    op.execute("CREATE INDEX events_owner_idx ON events ((data ->> 'owner'), position)")
    op.execute(
        "CREATE INDEX events_lease_start_idx ON events (stream_id, ((data ->> 'fencing_token')::bigint))"
        " WHERE event_type = 'LOCK_ACQUIRED'"
    )


def downgrade() -> None:
    for index in ("events_lease_start_idx", "events_owner_idx", "events_lease_span_idx"):
        op.execute(f"DROP INDEX {index}")
    op.execute("DROP FUNCTION event_deadline(jsonb)")
