"""The queue of waiting acquires (``lock_queue``) and the probe the command path asks it with.

A waiting acquire takes a ticket (a row, numbered by an identity sequence) in arrival order; a free lock
is granted only to the first live ticket while any waits (docs/decisions/0049-fair-queues.md).
``lock_queue_ahead`` is VOLATILE on purpose: called inside the commit statement after the stream's head
row is locked, it reads with a fresh snapshot, so it sees every ticket committed before that lock was
taken, which the statement's own snapshot (taken at its start) may not.

The service role reads, inserts and deletes tickets; the read-only role reads them; the migrator owns
the table and the function.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATOR_ROLE = "lockledger_migrator"
SERVICE_ROLE = "lockledger_service"
READONLY_ROLE = "lockledger_readonly"


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE lock_queue (
            ticket bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            resource text NOT NULL,
            owner text NOT NULL,
            server text NOT NULL,
            since timestamptz NOT NULL,
            deadline timestamptz NOT NULL
        )"""
    )
    op.execute("CREATE INDEX lock_queue_resource_ticket_idx ON lock_queue (resource, ticket)")
    op.execute("CREATE INDEX lock_queue_deadline_idx ON lock_queue (deadline)")
    op.execute(
        """
        CREATE FUNCTION lock_queue_ahead(p_resource text, p_ticket bigint, p_at timestamptz)
        RETURNS boolean LANGUAGE sql VOLATILE AS $$
            SELECT EXISTS (
                SELECT 1 FROM lock_queue
                 WHERE resource = p_resource AND deadline > p_at
                   AND (p_ticket IS NULL OR ticket < p_ticket))
        $$"""
    )
    op.execute(f"GRANT SELECT, INSERT, DELETE ON lock_queue TO {SERVICE_ROLE}")
    op.execute(f"GRANT SELECT ON lock_queue TO {READONLY_ROLE}")
    op.execute(f"GRANT EXECUTE ON FUNCTION lock_queue_ahead(text, bigint, timestamptz) TO {SERVICE_ROLE}")
    op.execute(f"ALTER TABLE lock_queue OWNER TO {MIGRATOR_ROLE}")
    op.execute(f"ALTER FUNCTION lock_queue_ahead(text, bigint, timestamptz) OWNER TO {MIGRATOR_ROLE}")


def downgrade() -> None:
    op.execute("DROP FUNCTION lock_queue_ahead(text, bigint, timestamptz)")
    op.execute("DROP TABLE lock_queue")
