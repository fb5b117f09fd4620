"""API tokens: issued once, stored only as a hash, revoked by name.

A token is ``llt_`` and 256 random bits (URL-safe base64). It is shown once, at creation; the database
keeps its SHA-256, so neither a database dump nor a backup hands out working tokens. The token's name is
the principal: for an agent it is the owner of every lease it takes.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from domain.access import Principal, Role
from domain.resource import is_valid_owner
from eventstore.connection import Connection

PREFIX = "llt_"


class TokenError(ValueError):
    """A token request that cannot be honoured (bad name, a name ever used with another role)."""


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: int
    name: str
    role: Role
    created_at: datetime
    revoked_at: datetime | None


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def looks_like_a_token(token: str) -> bool:
    """Cheap shape check, so garbage never costs a database round trip."""
    return token.startswith(PREFIX) and 40 <= len(token) <= 100 and token.isascii()


async def create(conn: Connection, name: str, role: Role) -> str:
    """Issue a token for ``name``; the returned string is the only copy of it anywhere.

    A name keeps one role for good: a second token for the same name (for rotation) must have the same
    role, even when every earlier token of the name is revoked. The name is the principal that owns
    leases, idempotency keys and history; a token of another role under it would take over whatever
    the old one left live (an admin re-using a revoked agent's name would hold that agent's leases).
    """
    async with conn.transaction():
        # One creator at a time per name, so two concurrent creates cannot give a name two roles.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('lockledger.api_tokens:' || $1))", name)
        (token,) = await create_many(conn, [name], role)
    return token


async def create_many(conn: Connection, names: Sequence[str], role: Role) -> list[str]:
    """Issue one token per name, all with ``role``, in one statement (one round trip); the tokens in the
    order of ``names``, and again the only copies anywhere.

    All or nothing: when any name was ever used with another role, none is issued. Meant for
    issuing many fresh names at once (a fleet's agents, the benchmark's): unlike :func:`create` it takes
    no per-name advisory lock (thousands of them would overflow PostgreSQL's lock table), so a
    concurrent ``create`` of one of these very names with another role is not excluded.
    """
    bad = next((name for name in names if not is_valid_owner(name)), None)
    if bad is not None:
        raise TokenError(
            f"name {bad[:50]!r} must be 1-200 characters of [A-Za-z0-9._:@-] (it becomes the lease owner)"
        )
    if not names:
        return []
    issued = [PREFIX + secrets.token_urlsafe(32) for _ in names]
    row = await conn.fetchrow(
        """
        WITH batch AS (
            SELECT name, token_hash FROM unnest($1::text[], $3::bytea[]) AS t(name, token_hash)
        ), clash AS (
            SELECT t.name, t.role, bool_or(t.revoked_at IS NULL) AS live FROM api_tokens t
             WHERE t.name IN (SELECT name FROM batch) AND t.role <> $2
             GROUP BY t.name, t.role
             ORDER BY t.name, t.role
             LIMIT 1
        ), inserted AS (
            INSERT INTO api_tokens (name, role, token_hash)
            SELECT name, $2, token_hash FROM batch WHERE NOT EXISTS (SELECT FROM clash)
            RETURNING 1
        )
        SELECT (SELECT name FROM clash) AS clash_name, (SELECT role FROM clash) AS clash_role,
               (SELECT live FROM clash) AS clash_live, (SELECT count(*) FROM inserted) AS inserted
        """,
        list(names),
        role.value,
        [digest(token) for token in issued],
    )
    assert row is not None
    if row["clash_name"] is not None:
        name, role = row["clash_name"], row["clash_role"]
        held = "already has live tokens" if row["clash_live"] else "had tokens (all revoked now)"
        raise TokenError(
            f"{name} {held} with role {role}, and a name keeps its role for good: its leases and history"
            f" are that principal's; issue a {role} token, or choose a new name"
        )
    assert row["inserted"] == len(issued)
    return issued


async def find(conn: Connection, token: str) -> Principal | None:
    """The live principal behind ``token``, or None for an unknown or revoked token."""
    row = await conn.fetchrow(
        "SELECT name, role FROM api_tokens WHERE token_hash = $1 AND revoked_at IS NULL", digest(token)
    )
    return Principal(row["name"], Role(row["role"])) if row is not None else None


async def revoked_since(conn: Connection, since: datetime) -> tuple[datetime, list[bytes]]:
    """The database clock now, and the hashes of tokens revoked at or after ``since``."""
    row = await conn.fetchrow(
        "SELECT clock_timestamp() AS now,"
        " ARRAY(SELECT token_hash FROM api_tokens WHERE revoked_at >= $1) AS revoked",
        since,
    )
    assert row is not None
    return row["now"], [bytes(h) for h in row["revoked"]]


async def list_all(conn: Connection, *, include_revoked: bool = False) -> list[TokenInfo]:
    rows = await conn.fetch(
        "SELECT id, name, role, created_at, revoked_at FROM api_tokens"
        " WHERE $1 OR revoked_at IS NULL ORDER BY name, id",
        include_revoked,
    )
    return [TokenInfo(r["id"], r["name"], Role(r["role"]), r["created_at"], r["revoked_at"]) for r in rows]


async def revoke(conn: Connection, name: str) -> int:
    """Revoke every live token of ``name``; how many were revoked."""
    result = await conn.execute(
        "UPDATE api_tokens SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL", name
    )
    return int(result.split()[-1])
