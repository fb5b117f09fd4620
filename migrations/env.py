"""Alembic environment: runs migrations over asyncpg, the same driver the service uses."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

import projections.schema
import service.schema
from eventstore.dburl import database_url_from_env, sqlalchemy_url
from eventstore.schema import metadata

assert projections.schema
assert service.schema

config = context.config
target_metadata = metadata


def _url() -> str:
    url = config.attributes.get("database_url") or database_url_from_env()
    if not url:
        raise SystemExit("no database: set LOCKLEDGER_DATABASE_URL or use `lockledger migrate`")
    return sqlalchemy_url(url)


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_server_default=False)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(_url())
    async with engine.connect() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
