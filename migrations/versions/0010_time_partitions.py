"""The events table range-partitioned by recorded_at; stream heads keep each stream's versions unique.

The existing table becomes the first partition as it is: its rows, positions and hashes never move. It
loses its identity (the new parent's continues after the highest position the old one gave out) and its
chain trigger (the parent's is cloned onto every partition), is attached for the time it already covers
up to the next UTC midnight (one scan of it, to check the range), and the parent's indexes are built on
it where the old ones do not match. A DEFAULT partition takes any event no partition covers, so an
append never fails for a missing partition;
``events_create_partitions`` (the service's reaper calls it, ``service/reaper.py``) creates the next
ones ahead. Decision: docs/decisions/0044-time-partitioned-events.md.

PostgreSQL requires every unique index of a partitioned table to include the partition key, so
``(stream_id, stream_version)`` is kept unique by ``stream_heads`` instead: the chain trigger takes the
previous hash from the stream's head row and moves the head only from the version before the new one;
a second version 1 or a version already taken is refused as ``unique_violation`` on constraint
``events_stream_version_key``, the name the service has always matched.

Statement triggers are not inherited: every partition carries its own append-only and no-truncate
triggers, or a DELETE naming a partition would slip through.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from collections.abc import Sequence
from datetime import UTC

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATOR_ROLE = "lockledger_migrator"
SERVICE_ROLE = "lockledger_service"
READONLY_ROLE = "lockledger_readonly"

# Named as PostgreSQL names them (18 keeps NOT NULL constraints in the catalog; 15 ignores the names):
# the old table keeps these names while the new one is made, which would otherwise get "..._null1".
_COLUMNS = """
    position bigint CONSTRAINT events_position_not_null NOT NULL,
    stream_id text CONSTRAINT events_stream_id_not_null NOT NULL,
    stream_version bigint CONSTRAINT events_stream_version_not_null NOT NULL,
    event_id uuid DEFAULT gen_random_uuid() CONSTRAINT events_event_id_not_null NOT NULL,
    event_type text CONSTRAINT events_event_type_not_null NOT NULL,
    data jsonb CONSTRAINT events_data_not_null NOT NULL,
    metadata jsonb DEFAULT '{}'::jsonb CONSTRAINT events_metadata_not_null NOT NULL,
    recorded_at timestamp with time zone DEFAULT clock_timestamp()
        CONSTRAINT events_recorded_at_not_null NOT NULL,
    tx_id xid8 DEFAULT pg_current_xact_id() CONSTRAINT events_tx_id_not_null NOT NULL,
    hash bytea CONSTRAINT events_hash_not_null NOT NULL"""

# The text every event's hash covers (eventstore/verify.py recomputes it), unchanged since 0001.
_LINK = r"""convert_to(concat_ws('|',
        NEW.stream_id, NEW.stream_version::text, NEW.event_id::text, NEW.event_type,
        NEW.data::text, NEW.metadata::text,
        ((extract(epoch FROM NEW.recorded_at) * 1000000)::bigint)::text), 'UTF8')"""

# SECURITY DEFINER (owned by the migrator): the service's role may not write stream_heads itself, or it
# could move a head and append a version twice. Relations are schema-qualified for the same reason.
CHAIN_HASH = rf"""
CREATE OR REPLACE FUNCTION events_chain_hash() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF NEW.stream_version = 1 THEN
        NEW.hash := sha256({_LINK});
        INSERT INTO public.stream_heads (stream_id, version, hash) VALUES (NEW.stream_id, 1, NEW.hash)
            ON CONFLICT (stream_id) DO NOTHING;
    ELSE
        UPDATE public.stream_heads SET version = NEW.stream_version, hash = sha256(hash || {_LINK})
         WHERE stream_id = NEW.stream_id AND version = NEW.stream_version - 1
        RETURNING hash INTO NEW.hash;
    END IF;
    IF NOT FOUND THEN
        IF EXISTS (SELECT FROM public.stream_heads
                    WHERE stream_id = NEW.stream_id AND version >= NEW.stream_version) THEN
            RAISE EXCEPTION 'stream % already has version %', NEW.stream_id, NEW.stream_version
                USING ERRCODE = 'unique_violation', CONSTRAINT = 'events_stream_version_key',
                      TABLE = 'events';
        END IF;
        RAISE EXCEPTION 'stream % has no version % to chain to', NEW.stream_id, NEW.stream_version - 1
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NEW;
END
$$"""

OLD_CHAIN_HASH = rf"""
CREATE OR REPLACE FUNCTION events_chain_hash() RETURNS trigger LANGUAGE plpgsql SECURITY INVOKER AS $$
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
    NEW.hash := sha256(previous || {_LINK});
    RETURN NEW;
END
$$"""


def _statement_triggers(table: str) -> list[str]:
    return [
        f"CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON {table}"
        " FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change()",
        f"CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON {table}"
        " FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change()",
    ]


# Partitions from the greatest upper bound so far, one UTC day or month each (the first one may end
# early, to meet the period's boundary), until ``ahead`` periods past now are covered; contiguous, so a
# change of period never overlaps. A partition is made as a table of its own and then attached, which
# does not block appends (CREATE TABLE ... PARTITION OF would lock the parent). A range the DEFAULT
# partition already holds events of is left to it, with a warning (docs/operations.md).
CREATE_PARTITIONS = r"""
CREATE FUNCTION events_create_partitions(period text, ahead integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    step interval;
    lower_bound timestamptz;
    upper_bound timestamptz;
    partition_name text;
    created integer := 0;
BEGIN
    IF period NOT IN ('day', 'month') OR ahead < 0 THEN
        RAISE EXCEPTION 'partitions by day or month, zero or more ahead; not % and %', period, ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    step := ('1 ' || period)::interval;
    PERFORM pg_advisory_xact_lock(hashtext('lockledger.events_create_partitions'));
    SELECT max(substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''([^'']+)''\)')::timestamptz)
      INTO lower_bound
      FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = 'public.events'::regclass;
    lower_bound := coalesce(lower_bound, date_trunc('day', clock_timestamp(), 'UTC'));
    WHILE lower_bound <= clock_timestamp() + ahead * step LOOP
        upper_bound := date_trunc(period, lower_bound, 'UTC') + step;
        partition_name := 'events_p' || to_char(lower_bound AT TIME ZONE 'UTC', 'YYYYMMDD');
        BEGIN
            EXECUTE format('CREATE TABLE public.%I (LIKE public.events INCLUDING DEFAULTS)', partition_name);
            EXECUTE format('CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON public.%I'
                           ' FOR EACH STATEMENT EXECUTE FUNCTION public.events_refuse_change()',
                           partition_name);
            EXECUTE format('CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON public.%I'
                           ' FOR EACH STATEMENT EXECUTE FUNCTION public.events_refuse_change()',
                           partition_name);
            EXECUTE format('ALTER TABLE public.events ATTACH PARTITION public.%I'
                           ' FOR VALUES FROM (%L) TO (%L)', partition_name, lower_bound, upper_bound);
            created := created + 1;
        EXCEPTION WHEN check_violation THEN
            RAISE WARNING 'events_default holds events recorded in [%, %): that range stays there',
                lower_bound, upper_bound;
        END;
        lower_bound := upper_bound;
    END LOOP;
    RETURN created;
END
$$"""


def _own(*objects: str) -> None:
    for kind_and_name in objects:
        op.execute(f"ALTER {kind_and_name} OWNER TO {MIGRATOR_ROLE}")


def upgrade() -> None:
    op.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
    # Every stream's head, read through the old unique index before it goes.
    op.execute(
        "CREATE TABLE stream_heads (stream_id text NOT NULL, version bigint NOT NULL, hash bytea NOT NULL,"
        " CONSTRAINT stream_heads_pkey PRIMARY KEY (stream_id))"
    )
    op.execute(
        "INSERT INTO stream_heads SELECT DISTINCT ON (stream_id) stream_id, stream_version, hash"
        " FROM events ORDER BY stream_id, stream_version DESC"
    )
    # The old table's range: from its first event's day to the next UTC midnight after its last event
    # and after now. Its name follows the partitions' (events_pYYYYMMDD, the lower bound).
    bind = op.get_bind()
    lower, upper, first_position = bind.exec_driver_sql(
        "SELECT date_trunc('day', coalesce(min(recorded_at), clock_timestamp()), 'UTC'),"
        "       date_trunc('day', greatest(max(recorded_at), clock_timestamp()), 'UTC') + interval '1 day',"
        "       greatest((SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END"
        "                   FROM events_position_seq), max(position)) + 1"
        "  FROM events"
    ).one()
    legacy = "events_p" + lower.astimezone(UTC).strftime("%Y%m%d")
    op.execute(f"ALTER TABLE events RENAME TO {legacy}")
    op.execute(f"ALTER TABLE {legacy} ALTER position DROP IDENTITY")
    op.execute(f"DROP TRIGGER events_chain_hash ON {legacy}")
    op.execute(f"CREATE TABLE events ({_COLUMNS}) PARTITION BY RANGE (recorded_at)")
    op.execute(
        f"ALTER TABLE events ALTER position ADD GENERATED ALWAYS AS IDENTITY (START WITH {first_position})"
    )
    op.execute(
        f"ALTER TABLE events ATTACH PARTITION {legacy}"
        f" FOR VALUES FROM ('{lower.isoformat()}') TO ('{upper.isoformat()}')"
    )
    op.execute("CREATE TABLE events_default PARTITION OF events DEFAULT")
    # The parent's indexes: the old ones that match (recorded_at and replay's, 0005) are attached as they
    # are, the three whose keys changed are built on the old table.
    for old in ("events_pkey", "events_event_id_key", "events_stream_version_key"):
        op.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT {old}")
    op.execute("ALTER TABLE events ADD CONSTRAINT events_pkey PRIMARY KEY (position, recorded_at)")
    op.execute("ALTER TABLE events ADD CONSTRAINT events_event_id_key UNIQUE (event_id, recorded_at)")
    op.execute("CREATE INDEX events_stream_version_idx ON events (stream_id, stream_version)")
    for index in (
        "events_recorded_at_idx",
        "events_lease_span_idx",
        "events_owner_idx",
        "events_lease_start_idx",
    ):
        op.execute(f"ALTER INDEX {index} RENAME TO {legacy}_{index.removeprefix('events_')}")
    op.execute("CREATE INDEX events_recorded_at_idx ON events (recorded_at)")
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
    op.execute(CHAIN_HASH)
    op.execute(
        "CREATE TRIGGER events_chain_hash BEFORE INSERT ON events"
        " FOR EACH ROW EXECUTE FUNCTION events_chain_hash()"
    )
    for statement in [*_statement_triggers("events"), *_statement_triggers("events_default")]:
        op.execute(statement)
    op.execute(CREATE_PARTITIONS)
    op.execute("REVOKE ALL ON FUNCTION events_create_partitions(text, integer) FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION events_create_partitions(text, integer) TO {SERVICE_ROLE}")
    # The migrator owns what it creates; events_create_partitions creates tables as the migrator.
    op.execute(f"GRANT CREATE ON SCHEMA public TO {MIGRATOR_ROLE}")
    op.execute(f"GRANT SELECT, INSERT ON events TO {SERVICE_ROLE}")
    op.execute(f"GRANT SELECT ON events TO {READONLY_ROLE}")
    op.execute(f"GRANT SELECT ON stream_heads TO {SERVICE_ROLE}, {READONLY_ROLE}")
    op.execute(f"REVOKE ALL ON {legacy} FROM {SERVICE_ROLE}, {READONLY_ROLE}")
    _own(
        "TABLE events",
        "TABLE events_default",
        "TABLE stream_heads",
        "FUNCTION events_chain_hash()",
        "FUNCTION events_create_partitions(text, integer)",
    )
    op.execute("SELECT events_create_partitions('day', 1)")


def downgrade() -> None:
    # One plain table again, with every event's position and hash as they are.
    op.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
    op.execute("ALTER TABLE events RENAME TO events_partitioned")
    op.execute(f"CREATE TABLE events ({_COLUMNS})")
    op.execute("INSERT INTO events SELECT * FROM events_partitioned ORDER BY position")
    bind = op.get_bind()
    next_position = bind.exec_driver_sql(
        "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM events_position_seq"
    ).scalar_one()
    op.execute("DROP TABLE events_partitioned")
    op.execute(
        f"ALTER TABLE events ALTER position ADD GENERATED ALWAYS AS IDENTITY (START WITH {next_position})"
    )
    op.execute("ALTER TABLE events ADD CONSTRAINT events_pkey PRIMARY KEY (position)")
    op.execute("ALTER TABLE events ADD CONSTRAINT events_event_id_key UNIQUE (event_id)")
    op.execute(
        "ALTER TABLE events ADD CONSTRAINT events_stream_version_key UNIQUE (stream_id, stream_version)"
    )
    op.execute("CREATE INDEX events_recorded_at_idx ON events (recorded_at)")
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
    op.execute("DROP FUNCTION events_create_partitions(text, integer)")
    op.execute(f"REVOKE CREATE ON SCHEMA public FROM {MIGRATOR_ROLE}")
    op.execute("DROP TABLE stream_heads")
    op.execute(OLD_CHAIN_HASH)
    op.execute(
        "CREATE TRIGGER events_chain_hash BEFORE INSERT ON events"
        " FOR EACH ROW EXECUTE FUNCTION events_chain_hash()"
    )
    for statement in _statement_triggers("events"):
        op.execute(statement)
    op.execute(f"GRANT SELECT, INSERT ON events TO {SERVICE_ROLE}")
    op.execute(f"GRANT SELECT ON events TO {READONLY_ROLE}")
    _own("TABLE events")
