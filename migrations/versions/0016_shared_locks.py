"""Shared locks and semaphores (docs/decisions/0051-shared-locks.md): their heads and grants, and the
mode of a waiting acquire.

- ``shared_locks``: one row per shared lock, its stream head (``projections/shared_locks.py``).
- ``shared_holders``: a row per grant not yet released or expired, indexed by deadline for the reaper.
- ``lock_queue.exclusive``: whether a ticket waits for an exclusive grant (every mutex ticket does). A
  reader waits only for the exclusive tickets ahead of it: ``shared_queue_ahead``, VOLATILE as
  ``lock_queue_ahead`` is, so that inside the commit statement it sees every ticket committed before the
  head row was locked.

The service role reads and writes the tables, the read-only role reads them; the migrator owns them.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATOR_ROLE = "lockledger_migrator"
SERVICE_ROLE = "lockledger_service"
READONLY_ROLE = "lockledger_readonly"
_FUNCTION = "shared_queue_ahead(text, bigint, timestamptz, boolean)"


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE shared_locks (
            resource text PRIMARY KEY,
            version bigint NOT NULL,
            updated_at timestamptz NOT NULL
        )"""
    )
    op.execute(
        """
        CREATE TABLE shared_holders (
            resource text NOT NULL,
            fencing_token bigint NOT NULL,
            owner text NOT NULL,
            mode text NOT NULL,
            lock_limit integer,
            ttl_ms integer NOT NULL,
            granted_at timestamptz NOT NULL,
            expires_at timestamptz NOT NULL,
            CONSTRAINT shared_holders_pkey PRIMARY KEY (resource, fencing_token),
            CONSTRAINT shared_holders_mode_check CHECK (mode IN ('shared', 'exclusive'))
        )"""
    )
    op.execute("CREATE INDEX shared_holders_expires_at_idx ON shared_holders (expires_at)")
    op.execute("ALTER TABLE lock_queue ADD COLUMN exclusive boolean NOT NULL DEFAULT true")
    op.execute(
        """
        CREATE FUNCTION shared_queue_ahead(p_stream text, p_ticket bigint, p_at timestamptz,
                                           p_exclusive_only boolean)
        RETURNS boolean LANGUAGE sql VOLATILE AS $$
            SELECT EXISTS (
                SELECT 1 FROM lock_queue
                 WHERE resource = p_stream AND deadline > p_at
                   AND (p_ticket IS NULL OR ticket < p_ticket)
                   AND (exclusive OR NOT p_exclusive_only))
        $$"""
    )
    for table in ("shared_locks", "shared_holders"):
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {SERVICE_ROLE}")
        op.execute(f"GRANT SELECT ON {table} TO {READONLY_ROLE}")
        op.execute(f"ALTER TABLE {table} OWNER TO {MIGRATOR_ROLE}")
    op.execute(f"GRANT EXECUTE ON FUNCTION {_FUNCTION} TO {SERVICE_ROLE}")
    op.execute(f"ALTER FUNCTION {_FUNCTION} OWNER TO {MIGRATOR_ROLE}")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {_FUNCTION}")
    op.execute("ALTER TABLE lock_queue DROP COLUMN exclusive")
    op.execute("DROP TABLE shared_holders")
    op.execute("DROP TABLE shared_locks")
