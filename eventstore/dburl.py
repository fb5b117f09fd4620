"""Database URLs: what the user gives (``postgresql://...``) and what each driver wants."""

from __future__ import annotations

import os

DATABASE_URL_ENV = "LOCKLEDGER_DATABASE_URL"


def database_url_from_env() -> str | None:
    return os.environ.get(DATABASE_URL_ENV) or None


def sqlalchemy_url(url: str) -> str:
    """The same URL for SQLAlchemy's asyncpg dialect (alembic)."""
    for prefix in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    raise ValueError(f"not a PostgreSQL URL: {url.split('@')[-1]}")


def asyncpg_dsn(url: str) -> str:
    """The same URL for asyncpg itself, which does not accept a ``+driver`` suffix."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)
