"""Unit tests of the lock decider: ``decide`` and ``evolve`` over hand-built states and commands."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from domain.commands import Acquire, Command, Expire, ForceRelease, Release, Renew
from domain.decider import decide, evolve, fold
from domain.errors import InvalidCommand, LeaseExpired, LockHeld, NotHolder
from domain.events import (
    LOCK_ACQUIRED,
    LOCK_EXPIRED,
    LOCK_FORCE_RELEASED,
    LOCK_RELEASED,
    LOCK_RENEWED,
    PAYLOAD_FIELDS,
    PAYLOAD_TYPES,
    Event,
    LockAcquired,
    LockExpired,
    LockForceReleased,
    LockHandedOff,
    LockReleased,
    LockRenewed,
    event_from_payload,
    event_payload,
    stamp,
)
from domain.resource import TtlBounds
from domain.state import LockState, initial_state, is_expired
from domain.timestamps import format_timestamp

RES = "pallet:42"
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
TTL = 10_000


def ms(n: int) -> timedelta:
    return timedelta(milliseconds=n)


def apply(state: LockState, command: Command, now: datetime, bounds: TtlBounds | None = None) -> LockState:
    """Decide, append at the same instant (``stamp``), and fold the resulting events into ``state``."""
    events = decide(state, command, now) if bounds is None else decide(state, command, now, bounds)
    return fold(state, stamp(events, now))


def held_by(owner: str = "agent-1", ttl_ms: int = TTL, at: datetime = T0) -> LockState:
    """A lock on ``RES`` freshly acquired by ``owner`` at ``at``."""
    return apply(initial_state(RES), Acquire(RES, owner, ttl_ms), at)


# --- acquire -----------------------------------------------------------------------------------------


def test_acquire_free_lock_grants_lease_with_token_version_plus_one() -> None:
    state = initial_state(RES)
    events = decide(state, Acquire(RES, "agent-1", TTL), T0)
    assert events == [LockAcquired(RES, "agent-1", 1, TTL, None)]  # the append stamps the deadline
    new = fold(state, stamp(events, T0))
    assert new.version == 1
    assert new.status == "held"
    assert new.owner == "agent-1"
    assert new.fencing_token == 1
    assert new.ttl_ms == TTL
    assert new.expires_at == T0 + ms(TTL)
    assert new.ended_by is None
    assert new.is_live(T0)
    assert not new.is_lapsed(T0)


def test_acquire_after_release_token_is_new_version_plus_one() -> None:
    state = held_by()
    state = apply(state, Release(RES, "agent-1", 1), T0 + ms(100))
    assert state.version == 2
    events = decide(state, Acquire(RES, "agent-2", TTL), T0 + ms(200))
    assert len(events) == 1
    assert isinstance(events[0], LockAcquired)
    assert events[0].fencing_token == state.version + 1 == 3
    assert events[0].owner == "agent-2"


def test_acquire_after_renewals_token_skips_renewal_versions() -> None:
    state = held_by()
    state = apply(state, Renew(RES, "agent-1", 1), T0 + ms(1000))
    state = apply(state, Renew(RES, "agent-1", 1), T0 + ms(2000))
    state = apply(state, Release(RES, "agent-1", 1), T0 + ms(3000))
    assert state.version == 4
    events = decide(state, Acquire(RES, "agent-2", TTL), T0 + ms(3000))
    assert [type(e) for e in events] == [LockAcquired]
    assert events[0].fencing_token == 5


def test_acquire_on_live_lease_raises_lock_held_with_holder_and_expiry() -> None:
    state = held_by("agent-1")
    with pytest.raises(LockHeld) as info:
        decide(state, Acquire(RES, "agent-2", TTL), T0 + ms(TTL - 1))
    err = info.value
    assert err.code == "lock_held"
    assert err.resource == RES
    assert err.holder == "agent-1"
    assert err.expires_at == T0 + ms(TTL)
    assert err.fencing_token == 1


def test_acquire_is_not_reentrant_for_the_holder() -> None:
    state = held_by("agent-1")
    with pytest.raises(LockHeld):
        decide(state, Acquire(RES, "agent-1", TTL), T0 + ms(1))


@pytest.mark.parametrize("late_ms", [0, 1, 60_000])
def test_acquire_on_lapsed_lease_expires_then_acquires(late_ms: int) -> None:
    state = held_by("agent-1")
    now = T0 + ms(TTL + late_ms)  # now >= expires_at: the lease has lapsed
    assert state.is_lapsed(now)
    events = decide(state, Acquire(RES, "agent-2", 5_000), now)
    assert events == [
        LockExpired(RES, "agent-1", 1, T0 + ms(TTL)),
        LockAcquired(RES, "agent-2", state.version + 2, 5_000, None),
    ]
    assert events[1].fencing_token == 3
    new = fold(state, stamp(events, now))
    assert new.version == 3
    assert new.owner == "agent-2"
    assert new.fencing_token == 3
    assert new.is_live(now)


def test_acquire_on_lapsed_lease_by_same_owner_gets_new_token() -> None:
    state = held_by("agent-1")
    now = T0 + ms(TTL)
    events = decide(state, Acquire(RES, "agent-1", TTL), now)
    assert [type(e) for e in events] == [LockExpired, LockAcquired]
    assert events[1].fencing_token == 3
    assert events[1].fencing_token != state.fencing_token


def test_acquire_after_reaped_expiry_only_acquires() -> None:
    state = held_by("agent-1")
    state = apply(state, Expire(RES), T0 + ms(TTL))
    assert state.status == "free"
    assert state.ended_by == LOCK_EXPIRED
    events = decide(state, Acquire(RES, "agent-2", TTL), T0 + ms(TTL + 1))
    assert [type(e) for e in events] == [LockAcquired]
    assert events[0].fencing_token == 3


def test_acquire_after_force_release_only_acquires() -> None:
    state = held_by("agent-1")
    state = apply(state, ForceRelease(RES, "robot powered off"), T0 + ms(1))
    events = decide(state, Acquire(RES, "agent-2", TTL), T0 + ms(2))
    assert [type(e) for e in events] == [LockAcquired]
    assert events[0].fencing_token == 3


# --- renew -------------------------------------------------------------------------------------------


def test_renew_by_holder_extends_deadline_from_now() -> None:
    state = held_by("agent-1", ttl_ms=TTL)
    now = T0 + ms(4_000)
    events = decide(state, Renew(RES, "agent-1", 1, 20_000), now)
    assert events == [LockRenewed(RES, "agent-1", 1, 20_000, None)]
    new = fold(state, stamp(events, now))
    assert new.version == 2
    assert new.status == "held"
    assert new.fencing_token == 1
    assert new.ttl_ms == 20_000
    assert new.expires_at == now + ms(20_000)


def test_renew_without_ttl_keeps_the_lease_ttl() -> None:
    state = held_by("agent-1", ttl_ms=7_500)
    now = T0 + ms(3_000)
    events = decide(state, Renew(RES, "agent-1", 1), now)
    assert stamp(events, now) == [LockRenewed(RES, "agent-1", 1, 7_500, now + ms(7_500))]


def test_renew_without_ttl_keeps_the_ttl_of_the_last_renewal() -> None:
    state = held_by("agent-1", ttl_ms=7_500)
    state = apply(state, Renew(RES, "agent-1", 1, 12_000), T0 + ms(1_000))
    now = T0 + ms(2_000)
    events = decide(state, Renew(RES, "agent-1", 1), now)
    assert isinstance(events[0], LockRenewed)
    assert events[0].ttl_ms == 12_000
    assert stamp(events, now)[0].expires_at == now + ms(12_000)


def test_renew_just_before_deadline_succeeds() -> None:
    state = held_by("agent-1")
    events = decide(state, Renew(RES, "agent-1", 1), T0 + ms(TTL - 1))
    assert [type(e) for e in events] == [LockRenewed]


def test_renew_by_other_owner_raises_not_holder() -> None:
    state = held_by("agent-1")
    with pytest.raises(NotHolder) as info:
        decide(state, Renew(RES, "agent-2", 1), T0 + ms(1))
    assert info.value.code == "not_holder"
    assert info.value.resource == RES


@pytest.mark.parametrize("token", [0, 2, 99, -1])
def test_renew_with_wrong_token_raises_not_holder(token: int) -> None:
    state = held_by("agent-1")
    with pytest.raises(NotHolder):
        decide(state, Renew(RES, "agent-1", token), T0 + ms(1))


def test_renew_on_never_taken_lock_raises_not_holder() -> None:
    with pytest.raises(NotHolder):
        decide(initial_state(RES), Renew(RES, "agent-1", 0), T0)
    with pytest.raises(NotHolder):
        decide(initial_state(RES), Renew(RES, "agent-1", 1), T0)


def test_renew_with_stale_token_after_reacquire_raises_not_holder() -> None:
    state = held_by("agent-1")
    state = apply(state, Acquire(RES, "agent-1", TTL), T0 + ms(TTL))  # lapsed, re-acquired: token 3
    assert state.fencing_token == 3
    with pytest.raises(NotHolder):
        decide(state, Renew(RES, "agent-1", 1), T0 + ms(TTL + 1))


@pytest.mark.parametrize("late_ms", [0, 1, 3_600_000])
def test_renew_after_deadline_raises_lease_expired_without_expiry_event(late_ms: int) -> None:
    state = held_by("agent-1")
    assert state.status == "held"  # no LOCK_EXPIRED appended yet
    with pytest.raises(LeaseExpired) as info:
        decide(state, Renew(RES, "agent-1", 1), T0 + ms(TTL + late_ms))
    assert info.value.code == "lease_expired"
    assert info.value.expired_at == T0 + ms(TTL)


def test_renew_after_reaped_expiry_raises_lease_expired() -> None:
    state = held_by("agent-1")
    state = apply(state, Expire(RES), T0 + ms(TTL + 5))
    with pytest.raises(LeaseExpired) as info:
        decide(state, Renew(RES, "agent-1", 1), T0 + ms(TTL + 10))
    assert info.value.expired_at == T0 + ms(TTL)


def test_renew_after_release_raises_not_holder() -> None:
    state = held_by("agent-1")
    state = apply(state, Release(RES, "agent-1", 1), T0 + ms(10))
    with pytest.raises(NotHolder):
        decide(state, Renew(RES, "agent-1", 1), T0 + ms(20))


def test_renew_after_force_release_raises_not_holder() -> None:
    state = held_by("agent-1")
    state = apply(state, ForceRelease(RES, "maintenance"), T0 + ms(10))
    with pytest.raises(NotHolder):
        decide(state, Renew(RES, "agent-1", 1), T0 + ms(20))


# --- release -----------------------------------------------------------------------------------------


def test_release_by_holder_frees_the_lock() -> None:
    state = held_by("agent-1")
    events = decide(state, Release(RES, "agent-1", 1), T0 + ms(500))
    assert events == [LockReleased(RES, "agent-1", 1, T0 + ms(TTL))]
    new = fold(state, events)
    assert new.status == "free"
    assert new.version == 2
    assert new.ended_by == LOCK_RELEASED
    assert new.fencing_token == 1
    assert not new.is_live(T0 + ms(500))
    assert not new.is_lapsed(T0 + ms(TTL + 1))


def test_release_by_other_owner_raises_not_holder() -> None:
    state = held_by("agent-1")
    with pytest.raises(NotHolder):
        decide(state, Release(RES, "agent-2", 1), T0 + ms(1))


@pytest.mark.parametrize("token", [0, 2, 99])
def test_release_with_wrong_token_raises_not_holder(token: int) -> None:
    state = held_by("agent-1")
    with pytest.raises(NotHolder):
        decide(state, Release(RES, "agent-1", token), T0 + ms(1))


def test_release_on_never_taken_lock_raises_not_holder() -> None:
    with pytest.raises(NotHolder):
        decide(initial_state(RES), Release(RES, "agent-1", 0), T0)


def test_release_after_deadline_raises_lease_expired_without_expiry_event() -> None:
    state = held_by("agent-1")
    with pytest.raises(LeaseExpired):
        decide(state, Release(RES, "agent-1", 1), T0 + ms(TTL))


def test_release_after_reaped_expiry_raises_lease_expired() -> None:
    state = held_by("agent-1")
    state = apply(state, Expire(RES), T0 + ms(TTL))
    with pytest.raises(LeaseExpired):
        decide(state, Release(RES, "agent-1", 1), T0 + ms(TTL + 1))


def test_release_twice_raises_not_holder() -> None:
    state = held_by("agent-1")
    state = apply(state, Release(RES, "agent-1", 1), T0 + ms(1))
    with pytest.raises(NotHolder):
        decide(state, Release(RES, "agent-1", 1), T0 + ms(2))


def test_release_after_force_release_raises_not_holder() -> None:
    state = held_by("agent-1")
    state = apply(state, ForceRelease(RES, "maintenance"), T0 + ms(1))
    with pytest.raises(NotHolder):
        decide(state, Release(RES, "agent-1", 1), T0 + ms(2))


# --- expire ------------------------------------------------------------------------------------------


def test_expire_live_lease_is_a_no_op() -> None:
    state = held_by("agent-1")
    assert decide(state, Expire(RES), T0 + ms(TTL - 1)) == []


def test_expire_free_lock_is_a_no_op() -> None:
    assert decide(initial_state(RES), Expire(RES), T0) == []
    released = apply(held_by("agent-1"), Release(RES, "agent-1", 1), T0 + ms(1))
    assert decide(released, Expire(RES), T0 + ms(TTL * 2)) == []


@pytest.mark.parametrize("late_ms", [0, 1, 90_000])
def test_expire_lapsed_lease_appends_lock_expired(late_ms: int) -> None:
    state = held_by("agent-1")
    events = decide(state, Expire(RES), T0 + ms(TTL + late_ms))
    assert events == [LockExpired(RES, "agent-1", 1, T0 + ms(TTL))]
    new = fold(state, events)
    assert new.status == "free"
    assert new.ended_by == LOCK_EXPIRED
    assert new.version == 2


def test_expire_twice_appends_only_once() -> None:
    state = held_by("agent-1")
    state = apply(state, Expire(RES), T0 + ms(TTL))
    assert decide(state, Expire(RES), T0 + ms(TTL + 1)) == []


def test_expire_after_renewal_uses_renewed_deadline() -> None:
    state = held_by("agent-1")
    state = apply(state, Renew(RES, "agent-1", 1), T0 + ms(5_000))
    assert decide(state, Expire(RES), T0 + ms(TTL + 1)) == []
    events = decide(state, Expire(RES), T0 + ms(5_000 + TTL))
    assert events == [LockExpired(RES, "agent-1", 1, T0 + ms(5_000 + TTL))]


# --- force release -----------------------------------------------------------------------------------


def test_force_release_live_lease_records_reason() -> None:
    state = held_by("agent-1")
    events = decide(state, ForceRelease(RES, "robot powered off by hand"), T0 + ms(5))
    assert events == [LockForceReleased(RES, "agent-1", 1, T0 + ms(TTL), "robot powered off by hand")]
    new = fold(state, events)
    assert new.status == "free"
    assert new.ended_by == LOCK_FORCE_RELEASED
    assert new.version == 2


def test_force_release_free_lock_is_a_no_op() -> None:
    assert decide(initial_state(RES), ForceRelease(RES, "why not"), T0) == []
    released = apply(held_by("agent-1"), Release(RES, "agent-1", 1), T0 + ms(1))
    assert decide(released, ForceRelease(RES, "again"), T0 + ms(2)) == []


def test_force_release_lapsed_lease_records_the_expiry() -> None:
    state = held_by("agent-1")
    events = decide(state, ForceRelease(RES, "cleanup"), T0 + ms(TTL))
    assert events == [LockExpired(RES, "agent-1", 1, T0 + ms(TTL))]


# --- validation --------------------------------------------------------------------------------------

BAD_RESOURCES = [
    "",
    "a/b",
    "/",
    "x" * 201,
    "pallet 42",
    "zone:A3\n",
    "caf\u00e9",
    "a?b",
    "a#b",
    "a%2Fb",
]


@pytest.mark.parametrize("resource", BAD_RESOURCES)
def test_bad_resource_names_are_invalid_for_every_command(resource: str) -> None:
    state = initial_state(resource)
    commands: list[Command] = [
        Acquire(resource, "agent-1", TTL),
        Renew(resource, "agent-1", 1),
        Release(resource, "agent-1", 1),
        Expire(resource),
        ForceRelease(resource, "reason"),
    ]
    for command in commands:
        with pytest.raises(InvalidCommand) as info:
            decide(state, command, T0)
        assert info.value.code == "validation_error"


@pytest.mark.parametrize("resource", ["a", "x" * 200, "pallet:42", "zone:A3", "a.b_c-d:E9"])
def test_good_resource_names_are_accepted(resource: str) -> None:
    events = decide(initial_state(resource), Acquire(resource, "agent-1", TTL), T0)
    assert [type(e) for e in events] == [LockAcquired]
    assert events[0].resource == resource


def test_command_for_another_resource_is_invalid() -> None:
    with pytest.raises(InvalidCommand):
        decide(initial_state("zone:A3"), Acquire("zone:A4", "agent-1", TTL), T0)


@pytest.mark.parametrize("owner", ["", "agent 1", "a/b", "o" * 201, "agent\n", "r\u00f6bot"])
def test_bad_owner_is_invalid(owner: str) -> None:
    state = held_by("agent-1")
    for command in (Acquire(RES, owner, TTL), Renew(RES, owner, 1), Release(RES, owner, 1)):
        with pytest.raises(InvalidCommand):
            decide(state, command, T0 + ms(1))


@pytest.mark.parametrize("owner", ["a", "o" * 200, "agv-7@fleet.example:eu"])
def test_good_owner_is_accepted(owner: str) -> None:
    events = decide(initial_state(RES), Acquire(RES, owner, TTL), T0)
    assert events[0].owner == owner


@pytest.mark.parametrize("ttl_ms", [-1, 0, 999, 3_600_001, 10**12])
def test_ttl_out_of_default_bounds_is_invalid(ttl_ms: int) -> None:
    with pytest.raises(InvalidCommand):
        decide(initial_state(RES), Acquire(RES, "agent-1", ttl_ms), T0)
    with pytest.raises(InvalidCommand):
        decide(held_by("agent-1"), Renew(RES, "agent-1", 1, ttl_ms), T0 + ms(1))


@pytest.mark.parametrize("ttl_ms", [1_000, 30_000, 3_600_000])
def test_ttl_at_default_bounds_is_accepted(ttl_ms: int) -> None:
    assert len(decide(initial_state(RES), Acquire(RES, "agent-1", ttl_ms), T0)) == 1
    assert len(decide(held_by("agent-1"), Renew(RES, "agent-1", 1, ttl_ms), T0 + ms(1))) == 1


def test_custom_ttl_bounds_are_honoured() -> None:
    bounds = TtlBounds(min_ms=500, max_ms=2_000, default_ms=1_000)
    assert len(decide(initial_state(RES), Acquire(RES, "agent-1", 500), T0, bounds)) == 1
    assert len(decide(initial_state(RES), Acquire(RES, "agent-1", 2_000), T0, bounds)) == 1
    for ttl_ms in (499, 2_001, 30_000):
        with pytest.raises(InvalidCommand):
            decide(initial_state(RES), Acquire(RES, "agent-1", ttl_ms), T0, bounds)


def test_validation_precedes_state_checks() -> None:
    # A held lock would answer lock_held; a malformed command is rejected as such first.
    with pytest.raises(InvalidCommand):
        decide(held_by("agent-1"), Acquire(RES, "agent-2", 1), T0 + ms(1))


def test_ttl_bounds_contains_is_inclusive() -> None:
    bounds = TtlBounds()
    assert bounds.contains(bounds.min_ms)
    assert bounds.contains(bounds.max_ms)
    assert not bounds.contains(bounds.min_ms - 1)
    assert not bounds.contains(bounds.max_ms + 1)
    assert bounds.contains(bounds.default_ms)


# --- evolve / fold -----------------------------------------------------------------------------------


def test_evolve_bumps_version_once_per_event() -> None:
    state = initial_state(RES)
    expires = T0 + ms(TTL)
    events: list[Event] = [
        LockAcquired(RES, "a", 1, TTL, expires),
        LockRenewed(RES, "a", 1, TTL, expires + ms(1)),
        LockReleased(RES, "a", 1, expires + ms(1)),
        LockAcquired(RES, "b", 4, TTL, expires + ms(2)),
        LockExpired(RES, "b", 4, expires + ms(2)),
        LockAcquired(RES, "c", 6, TTL, expires + ms(3)),
        LockForceReleased(RES, "c", 6, expires + ms(3), "ops"),
    ]
    for i, event in enumerate(events, start=1):
        state = evolve(state, event)
        assert state.version == i
    assert state == fold(initial_state(RES), events)


def test_last_event_determines_state() -> None:
    """Each event carries all it needs: evolving only the last event onto any prior state agrees."""
    expires = T0 + ms(TTL)
    last = LockAcquired(RES, "b", 4, 2_000, expires)
    from_scratch = evolve(LockState(RES, version=3), last)
    from_history = evolve(
        fold(
            initial_state(RES),
            [
                LockAcquired(RES, "a", 1, TTL, T0),
                LockRenewed(RES, "a", 1, 5_000, T0 + ms(1)),
                LockExpired(RES, "a", 1, T0 + ms(1)),
            ],
        ),
        last,
    )
    assert from_scratch == from_history
    assert from_history.owner == "b"
    assert from_history.fencing_token == 4
    assert from_history.ttl_ms == 2_000
    assert from_history.expires_at == expires
    assert from_history.ended_by is None


# --- payload round trip ------------------------------------------------------------------------------

ALL_EVENTS: list[Event] = [
    LockAcquired(RES, "agent-1", 1, TTL, T0 + ms(TTL)),
    LockRenewed(RES, "agent-1", 1, 20_000, T0 + ms(20_123)),
    LockReleased(RES, "agent-1", 1, T0 + ms(20_123)),
    LockExpired(RES, "agent-1", 7, datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)),
    LockForceReleased(RES, "agent-1", 9, T0 + ms(1), 'robot powered off by hand: \u00e9\u00e8 "quoted"'),
    LockForceReleased(RES, "agent-1", 9, T0 + ms(1), ""),
    LockHandedOff(RES, "agent-2", 3, 5_000, T0 + ms(5_000), "agent-1", 1),
]


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: e.type)
def test_event_payload_round_trip(event: Event) -> None:
    payload = event_payload(event)
    assert "type" not in payload
    assert "resource" not in payload
    back = event_from_payload(event.resource, event.type, payload)
    assert back == event
    assert type(back) is type(event)
    assert back.expires_at is not None
    assert back.expires_at.tzinfo is not None
    assert back.expires_at.utcoffset() == timedelta(0)


def test_every_event_type_is_covered_by_round_trip() -> None:
    assert {e.type for e in ALL_EVENTS} == set(PAYLOAD_FIELDS)


def test_event_payload_is_json_serializable_and_round_trips_through_json() -> None:
    import json

    for event in ALL_EVENTS:
        data = json.loads(json.dumps(event_payload(event)))
        assert event_from_payload(event.resource, event.type, data) == event


def test_event_payload_fields() -> None:
    # The deadline in the answers' one shape (RFC 3339, UTC, microseconds, Z): the export prints it as stored.
    assert event_payload(LockAcquired(RES, "a", 1, TTL, T0)) == {
        "owner": "a",
        "fencing_token": 1,
        "expires_at": format_timestamp(T0),
        "ttl_ms": TTL,
    }
    assert format_timestamp(T0).endswith("Z")
    assert event_payload(LockReleased(RES, "a", 1, T0)) == {
        "owner": "a",
        "fencing_token": 1,
        "expires_at": format_timestamp(T0),
    }
    # Events written before the shape was Z (``+00:00``) still read back.
    old = {"owner": "a", "fencing_token": 1, "expires_at": T0.isoformat()}
    assert event_from_payload(RES, "LOCK_RELEASED", old) == LockReleased(RES, "a", 1, T0)
    assert event_payload(LockForceReleased(RES, "a", 1, T0, "ops"))["reason"] == "ops"


def test_event_from_payload_rejects_unknown_type() -> None:
    with pytest.raises(ValueError, match="unknown lock event type"):
        event_from_payload(
            RES, "LOCK_STOLEN", {"owner": "a", "fencing_token": 1, "expires_at": T0.isoformat()}
        )


def test_decided_events_round_trip_through_payload_and_fold() -> None:
    state = initial_state(RES)
    emitted: list[Event] = []
    script: list[tuple[Command, datetime]] = [
        (Acquire(RES, "a", TTL), T0),
        (Renew(RES, "a", 1, 2_000), T0 + ms(1_000)),
        (Acquire(RES, "b", TTL), T0 + ms(3_000)),  # lapsed: expiry + acquire (token 4)
        (ForceRelease(RES, "ops"), T0 + ms(4_000)),
        (Acquire(RES, "c", TTL), T0 + ms(5_000)),
        (Release(RES, "c", 6), T0 + ms(6_000)),
    ]
    for command, now in script:
        events = stamp(decide(state, command, now), now)
        emitted.extend(events)
        state = fold(state, events)
    assert [e.type for e in emitted] == [
        LOCK_ACQUIRED,
        LOCK_RENEWED,
        LOCK_EXPIRED,
        LOCK_ACQUIRED,
        LOCK_FORCE_RELEASED,
        LOCK_ACQUIRED,
        LOCK_RELEASED,
    ]
    restored = [event_from_payload(RES, e.type, event_payload(e)) for e in emitted]
    assert restored == emitted
    assert fold(initial_state(RES), restored) == state
    assert state.version == len(emitted)


@pytest.mark.parametrize("reason", ["", "x" * 1001, "stuck\x00here"])
def test_force_release_reason_must_be_storable_text(reason: str) -> None:
    state = LockState(resource="zone:A3")
    with pytest.raises(InvalidCommand):
        decide(state, ForceRelease("zone:A3", reason), datetime(2026, 1, 1, tzinfo=UTC))


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: e.type)
def test_event_payload_writes_exactly_the_fields_of_the_payload_table(event: Event) -> None:
    payload = event_payload(event)
    assert tuple(payload) == PAYLOAD_FIELDS[event.type]
    for field in payload:
        expected = str if PAYLOAD_TYPES[field] is datetime else PAYLOAD_TYPES[field]
        assert isinstance(payload[field], expected), field


def test_the_expiry_rule_puts_the_deadline_itself_past_the_lease() -> None:
    assert not is_expired(T0, T0 - ms(1))
    assert is_expired(T0, T0)
    held = LockState(RES, 1, "held", "a", 1, TTL, T0)
    assert held.is_live(T0 - timedelta(microseconds=1))
    assert held.is_lapsed(T0)
    assert not held.is_live(T0)
