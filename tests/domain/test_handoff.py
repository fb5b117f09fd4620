"""Unit tests of hand-off decisions (docs/decisions/0047-lease-hand-off.md) over hand-built states; the
stateful test (test_decider_stateful.py) runs them among every other command."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from domain.commands import Accept, Acquire, Command, Decline, Expire, HandOff, Release, Renew
from domain.decider import decide, fold
from domain.errors import InvalidCommand, LeaseExpired, NotHolder, NotOwner
from domain.events import LockExpired, LockHandedOff, LockReleased, LockRenewed, stamp
from domain.resource import TtlBounds
from domain.state import LockState, initial_state

RES = "pallet:42"
T0 = datetime(2026, 3, 1, 8, 0, 0, tzinfo=UTC)


def ms(n: int) -> timedelta:
    return timedelta(milliseconds=n)


def apply(state: LockState, command: Command, now: datetime) -> LockState:
    return fold(state, stamp(decide(state, command, now), now))


def handed(at: datetime = T0) -> LockState:
    """agv-1 acquired (token 1) and renewed, then handed the lease to agv-2 at ``at`` for 5 s."""
    state = apply(initial_state(RES), Acquire(RES, "agv-1", 10_000), T0 - ms(2_000))
    state = apply(state, Renew(RES, "agv-1", 1), T0 - ms(1_000))
    return apply(state, HandOff(RES, "agv-1", 1, "agv-2", 5_000), at)


def test_hand_off_begins_the_receivers_lease_with_the_next_token() -> None:
    state = apply(initial_state(RES), Acquire(RES, "agv-1", 10_000), T0)
    events = decide(state, HandOff(RES, "agv-1", 1, "agv-2", 5_000), T0 + ms(1))
    assert events == [LockHandedOff(RES, "agv-2", 2, 5_000, None, "agv-1", 1)]
    after = fold(state, stamp(events, T0 + ms(1)))
    assert (after.status, after.owner, after.fencing_token) == ("held", "agv-2", 2)
    assert after.expires_at == T0 + ms(5_001)
    assert after.handed_off_by == "agv-1"


def test_the_givers_token_is_refused_from_the_hand_off_on() -> None:
    state = handed()
    for command in (
        Renew(RES, "agv-1", 1),
        Release(RES, "agv-1", 1),
        HandOff(RES, "agv-1", 1, "agv-3", 5_000),
    ):
        with pytest.raises(NotOwner):  # the lease is agv-2's now: 403 with authentication, else 409
            decide(state, command, T0 + ms(1))


def test_accept_renews_for_the_receivers_ttl_once() -> None:
    state = handed()
    events = decide(state, Accept(RES, "agv-2", 20_000), T0 + ms(4_999))
    assert events == [LockRenewed(RES, "agv-2", 3, 20_000, None)]
    accepted = fold(state, stamp(events, T0 + ms(4_999)))
    assert accepted.handed_off_by is None
    assert accepted.expires_at == T0 + ms(24_999)
    with pytest.raises(NotHolder):  # the token is handed out once
        decide(accepted, Accept(RES, "agv-2", 20_000), T0 + ms(5_000))
    # From then on it is an ordinary lease: renewed, released, handed on with its token.
    assert decide(accepted, Renew(RES, "agv-2", 3), T0 + ms(6_000))[0].fencing_token == 3


def test_a_receiver_that_knows_its_token_may_renew_instead_of_accepting() -> None:
    state = apply(handed(), Renew(RES, "agv-2", 3, 7_000), T0 + ms(1))
    assert state.handed_off_by is None
    with pytest.raises(NotHolder):
        decide(state, Accept(RES, "agv-2", 7_000), T0 + ms(2))


def test_decline_releases_the_lease() -> None:
    state = handed()
    events = decide(state, Decline(RES, "agv-2"), T0 + ms(10))
    assert events == [LockReleased(RES, "agv-2", 3, T0 + ms(5_000))]
    assert fold(state, events).status == "free"


@pytest.mark.parametrize("command", [Accept(RES, "agv-2", 20_000), Decline(RES, "agv-2")])
def test_a_hand_off_not_taken_up_by_its_deadline_lapses(command: Accept | Decline) -> None:
    state = handed()
    with pytest.raises(LeaseExpired):
        decide(state, command, T0 + ms(5_000))
    assert decide(state, Expire(RES), T0 + ms(5_000)) == [LockExpired(RES, "agv-2", 3, T0 + ms(5_000))]


@pytest.mark.parametrize("command", [Accept(RES, "agv-3", 20_000), Decline(RES, "agv-1")])
def test_only_the_receiver_takes_a_hand_off_up(command: Accept | Decline) -> None:
    with pytest.raises(NotHolder):
        decide(handed(), command, T0 + ms(1))


def test_nothing_to_accept_on_a_lock_never_handed_off() -> None:
    state = apply(initial_state(RES), Acquire(RES, "agv-2", 10_000), T0)
    with pytest.raises(NotHolder):
        decide(state, Accept(RES, "agv-2", 10_000), T0 + ms(1))
    with pytest.raises(NotHolder):
        decide(initial_state(RES), Decline(RES, "agv-2"), T0)


def test_hand_off_needs_the_live_lease_and_its_token() -> None:
    state = apply(initial_state(RES), Acquire(RES, "agv-1", 10_000), T0)
    with pytest.raises(NotHolder):
        decide(state, HandOff(RES, "agv-1", 7, "agv-2", 5_000), T0 + ms(1))
    with pytest.raises(LeaseExpired):
        decide(state, HandOff(RES, "agv-1", 1, "agv-2", 5_000), T0 + ms(10_000))
    released = apply(state, Release(RES, "agv-1", 1), T0 + ms(1))
    with pytest.raises(NotHolder):
        decide(released, HandOff(RES, "agv-1", 1, "agv-2", 5_000), T0 + ms(2))


@pytest.mark.parametrize(
    ("to", "within_ms"), [("agv-1", 5_000), ("agv 2", 5_000), ("", 5_000), ("agv-2", 999), ("agv-2", 60_001)]
)
def test_hand_off_fields_are_validated(to: str, within_ms: int) -> None:
    state = apply(initial_state(RES), Acquire(RES, "agv-1", 10_000), T0)
    bounds = TtlBounds(min_ms=1_000, max_ms=60_000)
    with pytest.raises(InvalidCommand):
        decide(state, HandOff(RES, "agv-1", 1, to, within_ms), T0 + ms(1), bounds)
