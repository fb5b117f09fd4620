"""API tokens, and a migrator role that owns the schema.

The schema's owner can disable triggers and rewrite history, so no role the service runs as may own it.
``lockledger_migrator`` (NOLOGIN: an administrator assumes it, or runs migrations as a superuser) owns
every table and function; the service role keeps only the grants it was given. Later migrations end with
``own_schema()`` again so new objects get the same owner.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATOR_ROLE = "lockledger_migrator"
SERVICE_ROLE = "lockledger_service"
TABLES = ["events", "lock_state", "idempotency_keys", "api_tokens", "alembic_version"]
FUNCTIONS = ["events_chain_hash()", "events_refuse_change()", "api_tokens_revocation_is_final()"]

# The service mints and revokes tokens for admins (POST and DELETE /v1/tokens), so it may insert rows and
# set revoked_at; it may not change a token's name, role or hash, delete one, or take a revocation back.
REVOCATION_IS_FINAL = [
    """
CREATE FUNCTION api_tokens_revocation_is_final() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.revoked_at IS NOT NULL AND NEW.revoked_at IS DISTINCT FROM OLD.revoked_at THEN
        RAISE EXCEPTION 'api token % is revoked for good', OLD.id USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END $$""",
    """
CREATE TRIGGER api_tokens_revocation_is_final BEFORE UPDATE ON api_tokens
    FOR EACH ROW EXECUTE FUNCTION api_tokens_revocation_is_final()""",
]


def own_schema(owner: str) -> None:
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} OWNER TO {owner}")  # owned identity sequences follow
    for function in FUNCTIONS:
        op.execute(f"ALTER FUNCTION {function} OWNER TO {owner}")


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("token_hash", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("revoked_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.CheckConstraint(
            "role IN ('agent', 'dashboard', 'investigator', 'admin')", name="api_tokens_role_check"
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("api_tokens_token_hash_key", "api_tokens", ["token_hash"], unique=True)
    op.create_index("api_tokens_name_idx", "api_tokens", ["name"])
    op.create_index(
        "api_tokens_revoked_at_idx",
        "api_tokens",
        ["revoked_at"],
        postgresql_where=sa.text("revoked_at IS NOT NULL"),
    )
    for statement in REVOCATION_IS_FINAL:
        op.execute(statement)
    op.execute(f"GRANT SELECT, INSERT ON api_tokens TO {SERVICE_ROLE}")
    op.execute(f"GRANT UPDATE (revoked_at) ON api_tokens TO {SERVICE_ROLE}")
    op.execute(
        f"""DO $$ BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{MIGRATOR_ROLE}') THEN
                CREATE ROLE {MIGRATOR_ROLE} NOLOGIN;
            END IF;
        END $$"""
    )
    op.execute(f"GRANT {MIGRATOR_ROLE} TO CURRENT_USER")
    own_schema(MIGRATOR_ROLE)


def downgrade() -> None:
    own_schema("CURRENT_USER")
    op.drop_table("api_tokens")
    op.execute("DROP FUNCTION IF EXISTS api_tokens_revocation_is_final()")
