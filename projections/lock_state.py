"""The lock_state projection in SQL: its writes (inline, in the command statement) and its expiry rule.

``lapsed_sql`` is ``domain.state.is_expired`` written for PostgreSQL, the one translation every statement
that applies the expiry rule uses (the reaper, waiting acquires, the append's liveness re-check), so the
database and the decider draw the line at the same instant: the deadline itself is already too late.
"""

from __future__ import annotations


def lapsed_sql(expires_at: str, now: str) -> str:
    """SQL that is true once ``now`` has reached ``expires_at`` (``domain.state.is_expired``)."""
    return f"({expires_at} <= {now})"


def live_sql(expires_at: str, now: str) -> str:
    """SQL that is true while ``now`` is before ``expires_at``: the negation of :func:`lapsed_sql`."""
    return f"(NOT {lapsed_sql(expires_at, now)})"


# The projection's writes, as parts of the command statement (service/lock_store.py), which runs them in
# the same transaction as the append. They read the relation of plans ``planned`` (columns resource,
# expected, n_events, status, owner, token, ttl, new_expires_at, ended_by, acquires (the plan begins a
# lease: an acquire or a hand-off), handed_off_by, require_live, ts, metadata)
# and touch lock_state only by key, so their plans stay index probes whatever the table held when they
# were prepared (tests/storage/test_statement_plans.py).


# The saga a lease was acquired in (the acquire's, or hand-off's, X-Saga-ID and X-Saga-Step) and the
# reservation it was taken in (a reserve's reservation_id), from the plan's metadata
# (service/lock_service.py, service/reservation_service.py). Kept, like acquired_at, until the next
# lease begins; rebuild reads the same keys from the last lease start's metadata, and the queries show
# them while it is live.
_START_KEYS = ("saga_id", "saga_step", "reservation_id")
_OF_ACQUIRE = ", ".join(f"CASE WHEN acquires THEN metadata ->> '{key}' END" for key in _START_KEYS)
_KEPT_UNTIL_NEXT_LEASE = ",\n           ".join(
    f"{key} = CASE WHEN excluded.acquired_at IS NULL THEN s.{key} ELSE excluded.{key} END"
    for key in _START_KEYS
)


def lock_heads_sql(plans: str) -> str:
    """The heads of the existing streams among ``plans`` (rows with ``cmd``, ``resource``, ``expected``),
    locked in resource order (so concurrent batches cannot deadlock on them), each only if still at the
    expected version: the serialization point of a resource. Yields ``cmd`` and ``held_until``."""
    return f"""
    SELECT existing.cmd, s.held_until
      FROM (SELECT cmd, resource, expected FROM {plans} WHERE expected > 0 ORDER BY resource) AS existing
     CROSS JOIN LATERAL (
           SELECT expires_at AS held_until FROM lock_state
            WHERE resource = existing.resource AND version = existing.expected
              FOR UPDATE
           ) AS s"""


def create_heads_sql(planned: str) -> str:
    """Insert the head row of each new stream among ``planned``; a concurrent creator of the same stream
    waits for the primary key, then loses (no row returned). Yields ``resource``."""
    return f"""
    INSERT INTO lock_state (resource, version, status, owner, fencing_token, ttl_ms, expires_at,
                            ended_by, acquired_at, updated_at, saga_id, saga_step, reservation_id,
                            handed_off_by)
    SELECT resource, n_events, status, owner, token, ttl, new_expires_at, ended_by,
           CASE WHEN acquires THEN ts END, ts, {_OF_ACQUIRE}, handed_off_by
      FROM {planned}
     WHERE expected = 0 AND NOT require_live
     ORDER BY resource
        ON CONFLICT (resource) DO NOTHING
 RETURNING resource"""


def advance_heads_sql(ok: str) -> str:
    """Move each existing stream's head among ``ok`` (plans that passed their checks) to its new state."""
    return f"""
    INSERT INTO lock_state AS s (resource, version, status, owner, fencing_token, ttl_ms, expires_at,
                                 ended_by, acquired_at, updated_at, saga_id, saga_step, reservation_id,
                                 handed_off_by)
    SELECT resource, expected + n_events, status, owner, token, ttl, new_expires_at, ended_by,
           CASE WHEN acquires THEN ts END, ts, {_OF_ACQUIRE}, handed_off_by
      FROM {ok}
     WHERE expected > 0
     ORDER BY resource
        ON CONFLICT (resource) DO UPDATE
       SET version = excluded.version, status = excluded.status, owner = excluded.owner,
           fencing_token = excluded.fencing_token, ttl_ms = excluded.ttl_ms,
           expires_at = excluded.expires_at, ended_by = excluded.ended_by,
           acquired_at = coalesce(excluded.acquired_at, s.acquired_at), updated_at = excluded.updated_at,
           {_KEPT_UNTIL_NEXT_LEASE},
           handed_off_by = excluded.handed_off_by
 RETURNING 1"""


def read_head_sql(resource: str) -> str:
    """The head row of ``resource`` (a text expression), looked up by key: at most one row."""
    return f"""
        SELECT version, status, owner, fencing_token, ttl_ms, expires_at, ended_by, handed_off_by
          FROM lock_state WHERE resource = {resource}
         LIMIT 1"""
