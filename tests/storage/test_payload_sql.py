"""The SQL that writes and reads event payloads, and applies the expiry rule, agrees with the domain.

``eventstore/payloads.py`` and ``projections/lock_state.py`` generate that SQL from ``domain/events.py``
and ``domain/state.py``; here PostgreSQL evaluates it and the domain's own functions read the result.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from domain.events import (
    DEADLINE_FIELD,
    GRANTING_EVENTS,
    LOCK_EXPIRED,
    PAYLOAD_FIELDS,
    LockAcquired,
    LockExpired,
    LockForceReleased,
    deadline,
    event_from_payload,
    event_payload,
)
from domain.state import is_expired
from eventstore.payloads import (
    build_payload_sql,
    deadline_sql,
    is_granting_sql,
    payload_field_sql,
    stamp_deadline_sql,
)
from projections.lock_state import lapsed_sql, live_sql

pytestmark = pytest.mark.storage

T0 = datetime(2026, 5, 5, 9, 30, 0, 123456, tzinfo=UTC)


async def test_a_payload_built_in_sql_is_read_by_the_domain(service_pool: asyncpg.Pool) -> None:
    sql = build_payload_sql(
        LOCK_EXPIRED, owner="$1::text", fencing_token="$2::bigint", expires_at="$3::timestamptz"
    )
    async with service_pool.acquire() as conn:
        data = await conn.fetchval(f"SELECT ({sql})::text", "bot1", 7, T0)
    assert event_from_payload("r", LOCK_EXPIRED, json.loads(data)) == LockExpired("r", "bot1", 7, T0)


def test_a_payload_built_in_sql_names_every_field() -> None:
    with pytest.raises(ValueError, match="fields"):
        build_payload_sql(LOCK_EXPIRED, owner="o", fencing_token="t")


async def test_sql_reads_every_field_the_domain_writes(service_pool: asyncpg.Pool) -> None:
    event = LockForceReleased("r", "bot1", 9, T0, "by hand")
    payload = event_payload(event)
    async with service_pool.acquire() as conn:
        for field in PAYLOAD_FIELDS[event.type]:
            read = await conn.fetchval(f"SELECT {payload_field_sql('$1::jsonb', field)}", json.dumps(payload))
            expected = T0 if field == DEADLINE_FIELD else payload[field]
            assert read == expected, field


async def test_the_stamped_deadline_is_the_one_the_domain_reads(service_pool: asyncpg.Pool) -> None:
    payload = event_payload(LockAcquired("r", "bot1", 1, 30_000, T0))
    del payload[DEADLINE_FIELD]
    stamped = T0 + timedelta(seconds=30)
    async with service_pool.acquire() as conn:
        data = await conn.fetchval(
            f"SELECT ({stamp_deadline_sql('$1::jsonb', '$2::timestamptz')})::text",
            json.dumps(payload),
            stamped,
        )
    assert event_from_payload("r", "LOCK_ACQUIRED", json.loads(data)).expires_at == stamped


async def test_granting_event_types_in_sql(service_pool: asyncpg.Pool) -> None:
    async with service_pool.acquire() as conn:
        for event_type in PAYLOAD_FIELDS:
            granting = await conn.fetchval(f"SELECT {is_granting_sql('$1::text')}", event_type)
            assert granting == (event_type in GRANTING_EVENTS), event_type


@pytest.mark.parametrize("offset_us", [-1, 0, 1])
async def test_the_database_draws_the_expiry_line_where_the_domain_does(
    service_pool: asyncpg.Pool, offset_us: int
) -> None:
    now = T0 + timedelta(microseconds=offset_us)
    async with service_pool.acquire() as conn:
        row = await conn.fetchrow(
            f"SELECT {lapsed_sql('$1::timestamptz', '$2::timestamptz')},"
            f" {live_sql('$1::timestamptz', '$2::timestamptz')}",
            T0,
            now,
        )
    assert row is not None
    assert row[0] == is_expired(T0, now)
    assert row[1] == (not is_expired(T0, now))


@pytest.mark.parametrize("ttl_ms", [1_000, 30_001, 3_600_000])
async def test_the_database_computes_the_deadline_the_domain_defines(
    service_pool: asyncpg.Pool, ttl_ms: int
) -> None:
    async with service_pool.acquire() as conn:
        computed = await conn.fetchval(f"SELECT {deadline_sql('$1::timestamptz', '$2::integer')}", T0, ttl_ms)
    assert computed == deadline(T0, ttl_ms)
