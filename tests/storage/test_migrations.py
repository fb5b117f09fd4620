"""The migrated database is exactly what the SQLAlchemy Core tables describe.

Two independent checks:

1. alembic's autogenerate comparison (``compare_metadata``) finds nothing to change. It cannot see
   everything: it reflects ``xid8`` as an unknown type and then skips that column's type comparison (it does
   report a column that became, say, ``bigint``), and it cannot compare the expression index
   ``resource text_pattern_ops`` nor the ``WHERE`` clause of partial indexes (it only notices such an index
   missing).
2. So the tables are also created from the metadata into a scratch schema, inside a transaction that is
   rolled back, and PostgreSQL's own catalog descriptions of both schemas (column types, nullability,
   defaults, identity; full index and constraint definitions) must be identical.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import projections.schema
import service.schema
from eventstore.dburl import sqlalchemy_url
from eventstore.schema import metadata

pytestmark = pytest.mark.storage

# Registering every table on the shared MetaData is a side effect of importing these modules.
assert projections.schema
assert service.schema

EXPECTED_TABLES = {
    "events",
    "stream_heads",
    "lock_state",
    "idempotency_keys",
    "api_tokens",
    "saga_state",
    "outage_beacon",
    "event_archives",
    "projector_checkpoints",
    "holding_periods",
    "agent_stats",
    "lock_queue",
    "shared_locks",
    "shared_holders",
}
SCRATCH = "lockledger_schema_check"


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_async_engine(sqlalchemy_url(database_url))
    try:
        yield eng
    finally:
        await eng.dispose()


def _differences(connection: Connection) -> list[Any]:
    # The partitions of events are made by the migration and the service, not declared: the parent is.
    partitions = set(connection.scalars(sa.text("SELECT relname FROM pg_class WHERE relispartition")))

    def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
        return not (type_ == "table" and name in partitions)

    context = MigrationContext.configure(
        connection, opts={"compare_type": True, "include_name": include_name}
    )
    with warnings.catch_warnings():
        # "Did not recognize type 'xid8'" and "expression compare cannot proceed": see the module docstring.
        warnings.filterwarnings("ignore", message=r"Did not recognize type 'xid8'")
        warnings.filterwarnings("ignore", message=r".*text_pattern_ops.*")
        warnings.filterwarnings("ignore", message=r".*expression-based index.*")
        return list(compare_metadata(context, metadata))


async def test_metadata_registers_every_table() -> None:
    assert set(metadata.tables) == EXPECTED_TABLES


async def test_alembic_finds_no_difference(engine: AsyncEngine) -> None:
    async with engine.connect() as connection:
        differences = await connection.run_sync(_differences)
    assert differences == []


_COLUMNS_SQL = """
SELECT c.relname AS table_name, a.attname AS column_name, format_type(a.atttypid, a.atttypmod) AS type,
       a.attnotnull AS not_null, a.attidentity::text AS identity,
       pg_get_expr(d.adbin, d.adrelid) AS column_default
  FROM pg_attribute a
  JOIN pg_class c ON c.oid = a.attrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE n.nspname = :schema AND c.relname = ANY(:tables) AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY 1, 2
"""

_INDEXES_SQL = """
SELECT tablename, indexname,
       replace(replace(indexdef, ' ON ONLY ' || schemaname || '.', ' ON ONLY '),
               ' ON ' || schemaname || '.', ' ON ') AS definition
  FROM pg_indexes
 WHERE schemaname = :schema AND tablename = ANY(:tables)
 ORDER BY 1, 2
"""

_CONSTRAINTS_SQL = """
SELECT c.relname AS table_name, k.conname, k.contype::text AS kind, pg_get_constraintdef(k.oid) AS definition
  FROM pg_constraint k
  JOIN pg_class c ON c.oid = k.conrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = :schema AND c.relname = ANY(:tables)
 ORDER BY 1, 2
"""


def _catalog(connection: Connection, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    params = {"schema": schema, "tables": sorted(EXPECTED_TABLES)}
    return {
        name: [tuple(row) for row in connection.execute(sa.text(sql), params)]
        for name, sql in (
            ("columns", _COLUMNS_SQL),
            ("indexes", _INDEXES_SQL),
            ("constraints", _CONSTRAINTS_SQL),
        )
    }


def _migrated_and_declared(connection: Connection) -> tuple[dict[str, Any], dict[str, Any]]:
    # One (autobegun) transaction, always rolled back: the scratch schema never becomes visible.
    try:
        migrated = _catalog(connection, "public")
        connection.exec_driver_sql(f"CREATE SCHEMA {SCRATCH}")
        # public stays on the path for the migration's functions that index expressions call; tables are
        # created in the scratch schema, first on the path, without looking for the public ones.
        connection.exec_driver_sql(f"SET LOCAL search_path TO {SCRATCH}, public")
        metadata.create_all(connection, checkfirst=False)
        declared = _catalog(connection, SCRATCH)
    finally:
        connection.rollback()
    return migrated, declared


async def test_catalog_of_migrated_schema_equals_the_declared_tables(engine: AsyncEngine) -> None:
    async with engine.connect() as connection:
        migrated, declared = await connection.run_sync(_migrated_and_declared)
    # Not vacuous: every table, and the columns alembic cannot compare, are there.
    assert {row[0] for row in migrated["columns"]} == EXPECTED_TABLES
    assert ("events", "tx_id", "xid8", True, "", "pg_current_xact_id()") in migrated["columns"]
    assert any("text_pattern_ops" in row[2] for row in migrated["indexes"])
    assert any("WHERE (status = 'held'::text)" in row[2] for row in migrated["indexes"])
    assert migrated["columns"] == declared["columns"]
    assert migrated["indexes"] == declared["indexes"]
    assert migrated["constraints"] == declared["constraints"]


async def test_scratch_schema_left_no_trace(engine: AsyncEngine) -> None:
    async with engine.connect() as connection:
        exists = await connection.scalar(
            sa.text("SELECT count(*) FROM pg_namespace WHERE nspname = :name"), {"name": SCRATCH}
        )
    assert exists == 0
