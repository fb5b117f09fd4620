"""The connection type every store function accepts: a bare asyncpg connection or one from a pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import asyncpg
    from asyncpg.pool import PoolConnectionProxy

# asyncpg's classes are generic only in its stubs, so the alias exists for the type checker alone.
Connection: TypeAlias = "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"
