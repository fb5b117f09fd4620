"""The event log, the lock_state projection, idempotency keys, append-only triggers, the service role.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SERVICE_ROLE = "lockledger_service"


class _Xid8(sa.types.UserDefinedType[object]):
    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        return "xid8"


# The hash of an event covers every column a reader trusts; verify (eventstore/verify.py) recomputes
# exactly this text. The first event of a stream chains to the empty string.
CHAIN_HASH = [
    r"""
CREATE FUNCTION events_chain_hash() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    previous bytea;
BEGIN
    IF NEW.stream_version = 1 THEN
        previous := ''::bytea;
    ELSE
        SELECT hash INTO previous FROM events
         WHERE stream_id = NEW.stream_id AND stream_version = NEW.stream_version - 1;
        IF previous IS NULL THEN
            RAISE EXCEPTION 'stream % has no version % to chain to', NEW.stream_id, NEW.stream_version - 1
                USING ERRCODE = 'foreign_key_violation';
        END IF;
    END IF;
    NEW.hash := sha256(previous || convert_to(concat_ws('|',
        NEW.stream_id, NEW.stream_version::text, NEW.event_id::text, NEW.event_type,
        NEW.data::text, NEW.metadata::text,
        ((extract(epoch FROM NEW.recorded_at) * 1000000)::bigint)::text), 'UTF8'));
    RETURN NEW;
END
$$
""",
    r"""
CREATE TRIGGER events_chain_hash BEFORE INSERT ON events
    FOR EACH ROW EXECUTE FUNCTION events_chain_hash()
""",
]

# Append-only, enforced by the database itself: statement-level, so even a DELETE matching no row fails.
APPEND_ONLY = [
    r"""
CREATE FUNCTION events_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events are append-only: % refused', TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$
""",
    """
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change()
""",
    """
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change()
""",
]

GRANTS = [
    f"""DO $$ BEGIN
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{SERVICE_ROLE}') THEN
            CREATE ROLE {SERVICE_ROLE} NOLOGIN;
        END IF;
    END $$""",
    f"GRANT {SERVICE_ROLE} TO CURRENT_USER",
    f"GRANT USAGE ON SCHEMA public TO {SERVICE_ROLE}",
    f"GRANT SELECT, INSERT ON events TO {SERVICE_ROLE}",
    f"GRANT SELECT, INSERT, UPDATE ON lock_state TO {SERVICE_ROLE}",
    f"GRANT SELECT, INSERT, DELETE ON idempotency_keys TO {SERVICE_ROLE}",
]


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("stream_id", sa.Text(), nullable=False),
        sa.Column("stream_version", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("data", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "metadata",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "recorded_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.Column("tx_id", _Xid8(), server_default=sa.text("pg_current_xact_id()"), nullable=False),
        sa.Column("hash", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("position"),
        sa.UniqueConstraint("event_id", name="events_event_id_key"),
        sa.UniqueConstraint("stream_id", "stream_version", name="events_stream_version_key"),
    )
    op.create_index("events_recorded_at_idx", "events", ["recorded_at"])
    op.create_table(
        "lock_state",
        sa.Column("resource", sa.Text(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("owner", sa.Text(), nullable=True),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("ttl_ms", sa.Integer(), nullable=True),
        sa.Column("expires_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("ended_by", sa.Text(), nullable=True),
        sa.Column("acquired_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("updated_at", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.CheckConstraint("status IN ('held', 'free')", name="lock_state_status_check"),
        sa.PrimaryKeyConstraint("resource"),
    )
    op.create_index(
        "lock_state_owner_idx", "lock_state", ["owner"], postgresql_where=sa.text("status = 'held'")
    )
    op.create_index(
        "lock_state_expires_at_idx", "lock_state", ["expires_at"], postgresql_where=sa.text("status = 'held'")
    )
    op.create_index("lock_state_resource_prefix_idx", "lock_state", [sa.text("resource text_pattern_ops")])
    op.create_table(
        "idempotency_keys",
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.LargeBinary(), nullable=False),
        sa.Column("resource", sa.Text(), nullable=False),
        sa.Column("status_code", sa.SmallInteger(), nullable=False),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("principal", "key", name="idempotency_keys_pkey"),
    )
    op.create_index("idempotency_keys_created_at_idx", "idempotency_keys", ["created_at"])
    for statement in [*CHAIN_HASH, *APPEND_ONLY, *GRANTS]:
        op.execute(statement)


def downgrade() -> None:
    op.execute(f"REVOKE ALL ON events, lock_state, idempotency_keys FROM {SERVICE_ROLE}")
    op.drop_table("idempotency_keys")
    op.drop_table("lock_state")
    op.drop_table("events")
    op.execute("DROP FUNCTION IF EXISTS events_refuse_change()")
    op.execute("DROP FUNCTION IF EXISTS events_chain_hash()")
