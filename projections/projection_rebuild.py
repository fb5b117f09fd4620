"""Rebuild an asynchronous projection in the background, then switch to it in one transaction.

The live table keeps serving (and its projector keeps applying) while a shadow table of the same shape
is built from the log in one statement (``projector.build``) and caught up by a projector of its own.
Once the shadow's checkpoint has reached the live one's, one transaction locks both checkpoints, gives the
shadow the live table's grants, drops the live table, renames the shadow (and its indexes) to the live
names and moves the shadow's checkpoint to the live name. The live table's runner, whose next step finds
its checkpoint moved, reads it again and carries on with the new table. Run it as the schema's owner.
"""

from __future__ import annotations

from eventstore.connection import Connection
from projections import checkpoints
from projections.checkpoints import Checkpoint
from projections.projector import Projection, Projector, build

SHADOW_SUFFIX = "_next"

_GRANTS_SQL = """
SELECT grantee, string_agg(privilege_type, ', ') AS privileges
  FROM information_schema.role_table_grants
 WHERE table_schema = current_schema() AND table_name = $1
   AND grantee <> (SELECT tableowner FROM pg_tables WHERE schemaname = current_schema() AND tablename = $1)
 GROUP BY grantee"""
_INDEXES_SQL = "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() AND tablename = $1"
_LOCKED_SQL = """SELECT name, lo FROM projector_checkpoints WHERE name = ANY($1::text[])
                  ORDER BY name FOR UPDATE"""


async def rebuild_projection(conn: Connection, projection: Projection, *, page: int = 2_000) -> Checkpoint:
    """Rebuild ``projection``'s table from the log beside the live one and switch to it; its checkpoint."""
    live, shadow = projection.name, projection.name + SHADOW_SUFFIX
    await conn.execute(f"DROP TABLE IF EXISTS {shadow}")
    await conn.execute(f"CREATE TABLE {shadow} (LIKE {live} INCLUDING ALL)")
    # The build joins events to itself across partitions, planned with the parent's statistics, which
    # autovacuum never gathers for a partitioned table (a non-owner's ANALYZE only warns and skips).
    await conn.execute("ANALYZE events")
    await build(conn, projection, shadow)
    projector = Projector(projection, table=shadow, page=page)
    while True:
        await projector.catch_up(conn)
        async with conn.transaction():
            rows = {r["name"]: r["lo"] for r in await conn.fetch(_LOCKED_SQL, [live, shadow])}
            if rows[shadow] < rows[live]:
                continue  # the live projector moved on meanwhile: catch up again
            caught_up = await checkpoints.load(conn, shadow)
            assert caught_up is not None
            await _switch(conn, live, shadow)
            switched = Checkpoint(live, caught_up.lo, caught_up.hi, caught_up.after, caught_up.covered_until)
            await checkpoints.store(conn, switched)
            await conn.execute("DELETE FROM projector_checkpoints WHERE name = $1", shadow)
            return switched


async def _switch(conn: Connection, live: str, shadow: str) -> None:
    for grant in await conn.fetch(_GRANTS_SQL, live):
        await conn.execute(f'GRANT {grant["privileges"]} ON {shadow} TO "{grant["grantee"]}"')
    await conn.execute(f"DROP TABLE {live}")
    await conn.execute(f"ALTER TABLE {shadow} RENAME TO {live}")
    for row in await conn.fetch(_INDEXES_SQL, live):
        name: str = row["indexname"]
        if name.startswith(shadow):
            await conn.execute(f"ALTER INDEX {name} RENAME TO {live}{name[len(shadow) :]}")
