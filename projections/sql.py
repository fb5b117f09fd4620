"""Running SQLAlchemy Core queries on asyncpg directly, so the service keeps one pool and one driver."""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

_DIALECT = asyncpg_dialect(paramstyle="numeric_dollar")  # type: ignore[no-untyped-call]


def compile_query(statement: ClauseElement) -> tuple[str, list[Any]]:
    """SQL text with ``$n`` placeholders and its positional parameters."""
    compiled = statement.compile(dialect=_DIALECT)
    assert isinstance(compiled, SQLCompiler)
    params = compiled.params
    names = compiled.positiontup or []
    return str(compiled), [params[name] for name in names]
