"""agent_stats: per agent and zone, how many leases it took, how long it held them, how many lapsed.

A zone is a resource's name up to its last ``:`` (``zone:A3:bay4`` is in ``zone:A3``, ``pallet:42`` in
``pallet``; a name without ``:`` is its own zone). Each lease begun (``LOCK_ACQUIRED``, or
``LOCK_HANDED_OFF`` for its receiver) counts a hold; each ending (``LOCK_RELEASED``, ``LOCK_EXPIRED``,
``LOCK_FORCE_RELEASED``, or ``LOCK_HANDED_OFF`` for its giver) counts an ended lease and adds its
holding time, from the lease's start to the earlier of the ending's record and the deadline it knew (a
lease that lapsed ended at its deadline, whenever the reaper recorded it); ``LOCK_EXPIRED`` also counts
a lapse.
Refused acquires ("conflicts") are not in the log, so they are not counted here.

The counters are sums, so they are kept exactly once by the projector's checkpoint, which moves in the
transaction that adds a page (``projections/projector.py``), not by re-deriving rows as holding_periods
does.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import BigInteger, Column, Table, Text

from domain.events import (
    DEADLINE_FIELD,
    LEASE_STARTS,
    LOCK_EXPIRED,
    LOCK_FORCE_RELEASED,
    LOCK_HANDED_OFF,
    LOCK_RELEASED,
)
from eventstore.connection import Connection
from eventstore.payloads import payload_field_sql
from eventstore.schema import metadata
from eventstore.tail import EventKey
from projections.projector import Projection, versions

NAME = "agent_stats"

agent_stats = Table(
    NAME,
    metadata,
    Column("owner", Text, primary_key=True),
    Column("zone", Text, primary_key=True),
    Column("holds", BigInteger, nullable=False),
    Column("ended", BigInteger, nullable=False),
    Column("held_ms", BigInteger, nullable=False),  # summed over the ended leases
    Column("lapses", BigInteger, nullable=False),
)

_ENDINGS = f"'{LOCK_RELEASED}', '{LOCK_EXPIRED}', '{LOCK_FORCE_RELEASED}'"
_STARTS = ", ".join(f"'{name}'" for name in sorted(LEASE_STARTS))
# Each event's contribution, summed per (owner, zone); ``{events}`` is a query of events rows. A share is
# one owner's part of an event: a hand-off has two, the receiver's hold and the giver's ended lease.
_ADD = f"""
WITH e AS ({{events}}),
share AS (
    SELECT e.data ->> 'owner' AS owner, e.stream_id, e.event_type IN ({_STARTS}) AS starts,
           e.event_type IN ({_ENDINGS}) AS ends, {payload_field_sql("e.data", "fencing_token")} AS token,
           least(e.recorded_at, {payload_field_sql("e.data", DEADLINE_FIELD)}) AS ended_at,
           e.event_type = '{LOCK_EXPIRED}' AS lapse
      FROM e WHERE e.event_type IN ({_STARTS}, {_ENDINGS})
    UNION ALL
    SELECT e.data ->> 'from_owner', e.stream_id, false, true, {payload_field_sql("e.data", "from_token")},
           e.recorded_at, false
      FROM e WHERE e.event_type = '{LOCK_HANDED_OFF}'
)
INSERT INTO {{table}} AS s (owner, zone, holds, ended, held_ms, lapses)
SELECT x.owner,
       CASE WHEN strpos(x.stream_id, ':') > 0 THEN regexp_replace(x.stream_id, ':[^:]*$', '')
            ELSE x.stream_id END,
       count(*) FILTER (WHERE x.starts),
       count(*) FILTER (WHERE x.ends),
       coalesce(sum(floor(extract(epoch FROM x.ended_at - a.recorded_at) * 1000)) FILTER (WHERE x.ends),
                0)::bigint,
       count(*) FILTER (WHERE x.lapse)
  FROM share AS x
  LEFT JOIN LATERAL (  -- the start of the lease that ended: its acquire or hand-off
        SELECT a.recorded_at FROM events a
         WHERE a.stream_id = x.stream_id AND a.event_type IN ({_STARTS})
           AND (a.data ->> 'fencing_token')::bigint = x.token
         LIMIT 1) AS a ON x.ends
 GROUP BY 1, 2
    ON CONFLICT (owner, zone) DO UPDATE
   SET holds = s.holds + excluded.holds, ended = s.ended + excluded.ended,
       held_ms = s.held_ms + excluded.held_ms, lapses = s.lapses + excluded.lapses
"""
_KEYED = """SELECT ev.* FROM unnest($1::text[], $2::bigint[]) AS k (s, v)
              JOIN events ev ON ev.stream_id = k.s AND ev.stream_version = k.v"""
_BELOW = "SELECT * FROM events WHERE tx_id < $1::text::xid8"


async def _apply(conn: Connection, table: str, events: list[EventKey]) -> None:
    keys = versions(events)
    if keys:
        streams, numbers = zip(*keys, strict=True)
        await conn.execute(_ADD.format(table=table, events=_KEYED), list(streams), list(numbers))


async def _build(conn: Connection, table: str, below: int) -> None:
    await conn.execute(_ADD.format(table=table, events=_BELOW), str(below))


AGENT_STATS = Projection(NAME, _apply, _build)


@dataclass(frozen=True, slots=True)
class AgentStats:
    owner: str
    holds: int
    ended: int
    mean_hold_ms: int | None  # over the ended leases (None: none ended yet)
    lapses: int


# Per agent over the zones starting with $1 (all when NULL), most leases first.
_BY_AGENT_SQL = f"""
SELECT owner, sum(holds)::bigint AS holds, sum(ended)::bigint AS ended,
       (sum(held_ms) / nullif(sum(ended), 0))::bigint AS mean_hold_ms, sum(lapses)::bigint AS lapses
  FROM {NAME}
 WHERE $1::text IS NULL OR starts_with(zone, $1)
 GROUP BY owner
 ORDER BY holds DESC, owner
 LIMIT $2
"""


async def by_agent(conn: Connection, *, zone_prefix: str | None = None, limit: int = 100) -> list[AgentStats]:
    """Each agent's figures over the zones starting with ``zone_prefix``, the busiest first."""
    return [AgentStats(*row.values()) for row in await conn.fetch(_BY_AGENT_SQL, zone_prefix, limit)]
