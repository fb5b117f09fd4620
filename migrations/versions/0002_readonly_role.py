"""A read-only role for the query and replay APIs (ready to point at a replica).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

READONLY_ROLE = "lockledger_readonly"


def upgrade() -> None:
    op.execute(
        f"""DO $$ BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{READONLY_ROLE}') THEN
                CREATE ROLE {READONLY_ROLE} NOLOGIN;
            END IF;
        END $$"""
    )
    op.execute(f"GRANT {READONLY_ROLE} TO CURRENT_USER")
    op.execute(f"GRANT USAGE ON SCHEMA public TO {READONLY_ROLE}")
    op.execute(f"GRANT SELECT ON events, lock_state TO {READONLY_ROLE}")


def downgrade() -> None:
    op.execute(f"REVOKE ALL ON events, lock_state FROM {READONLY_ROLE}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {READONLY_ROLE}")
