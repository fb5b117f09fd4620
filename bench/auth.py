"""API tokens for the bench's agents: the server under test runs with authentication on, as in production.

Every simulated agent gets its own ``agent`` token, minted before the load starts (one statement for all
of them, ``service.tokens.create_many``), and sends it as ``Authorization: Bearer`` on every request; the
token's name is the lease owner, so request bodies name no owner (as the SDK does with a token). Names
carry the run id: the database keeps its tokens between runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from domain.access import Role
from eventstore.dburl import asyncpg_dsn
from service import tokens

AUTH = "bearer"  # how the bench's requests authenticate, recorded with every run


def agent_names(prefix: str, count: int) -> list[str]:
    """``count`` token names (lease owners): ``<prefix><i>``; the prefix carries the run id."""
    return [f"{prefix}{i}" for i in range(count)]


async def mint_agent_tokens(database_url: str, names: Sequence[str]) -> list[str]:
    """One agent token per name, in the order of ``names``, minted in one round trip as the schema owner
    (a plain connection to ``database_url``; the service role may not write tokens)."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        return await tokens.create_many(conn, names, Role.AGENT)
    finally:
        await conn.close()


def bearer(token: str) -> str:
    """The ``Authorization`` header's value for ``token``."""
    return f"Bearer {token}"
