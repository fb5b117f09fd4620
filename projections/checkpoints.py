"""Projector checkpoints: where each asynchronously projected table stands in the log.

A checkpoint is the change feed's cursor (``eventstore/tail.py``) kept in the database: every event of a
transaction below ``lo`` is applied, those of ``[lo, hi)`` up to position ``after``, none from ``hi`` on.
Between windows (``lo = hi``), ``after`` is a position below every event of a transaction from ``lo`` on
(0 when none is known), where the next window's reading starts after a restart.
``covered_until`` is an instant by which every event recorded at or before it is applied (NULL: none
known yet), which is what lets replay trust the table for instants up to it. A projector moves its
checkpoint in the transaction that applies the events, and only from the checkpoint it read
(``advance``), so a batch is applied once even with several runners or a crash between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import BigInteger, Column, Table, Text
from sqlalchemy.dialects.postgresql import TIMESTAMP

from eventstore.connection import Connection
from eventstore.schema import metadata

projector_checkpoints = Table(
    "projector_checkpoints",
    metadata,
    Column("name", Text, primary_key=True),  # the table the projector writes
    Column("lo", BigInteger, nullable=False),
    Column("hi", BigInteger, nullable=False),
    Column("after", BigInteger, nullable=False),
    Column("covered_until", TIMESTAMP(timezone=True)),
    Column("updated_at", TIMESTAMP(timezone=True), nullable=False),
)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    name: str
    lo: int
    hi: int
    after: int
    covered_until: datetime | None


_COLUMNS = "name, lo, hi, after, covered_until"


async def load(conn: Connection, name: str) -> Checkpoint | None:
    row = await conn.fetchrow(f"SELECT {_COLUMNS} FROM projector_checkpoints WHERE name = $1", name)
    return None if row is None else Checkpoint(*row.values())


async def store(conn: Connection, checkpoint: Checkpoint) -> None:
    """Set ``checkpoint`` whatever stood before (a fresh build)."""
    await conn.execute(
        f"""INSERT INTO projector_checkpoints ({_COLUMNS}, updated_at)
            VALUES ($1, $2, $3, $4, $5, clock_timestamp())
            ON CONFLICT (name) DO UPDATE SET lo = excluded.lo, hi = excluded.hi, after = excluded.after,
                   covered_until = excluded.covered_until, updated_at = excluded.updated_at""",
        checkpoint.name, checkpoint.lo, checkpoint.hi, checkpoint.after, checkpoint.covered_until,
    )  # fmt: skip


async def advance(conn: Connection, old: Checkpoint, new: Checkpoint) -> datetime | None:
    """Move from ``old`` to ``new`` and return the database clock; None (nothing changed) when the stored
    checkpoint is not ``old``: another runner or a rebuild moved it. ``covered_until`` never moves back."""
    moved: datetime | None = await conn.fetchval(
        """UPDATE projector_checkpoints
              SET lo = $5, hi = $6, after = $7,
                  covered_until = greatest(covered_until, $8), updated_at = clock_timestamp()
            WHERE name = $1 AND lo = $2 AND hi = $3 AND after = $4
        RETURNING updated_at""",
        old.name, old.lo, old.hi, old.after, new.lo, new.hi, new.after, new.covered_until,
    )  # fmt: skip
    return moved
