"""The remembered lock states (service/state_cache.py): bounded, least recently used dropped first, and
the guess about unknown streams that stops while it fails."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from domain.state import LockState
from service.state_cache import NewStreamGuess, StateCache


def test_the_least_recently_put_state_is_dropped_first() -> None:
    cache = StateCache(capacity=2)
    cache.put(LockState("a", version=1))
    cache.put(LockState("b", version=1))
    cache.put(LockState("a", version=2))  # refreshed: now b is the oldest
    cache.put(LockState("c", version=1))
    assert cache.get("b") is None
    assert cache.get("a") == LockState("a", version=2)
    assert cache.get("c") == LockState("c", version=1)
    assert len(cache) == 2


def test_forget_drops_one_state_and_capacity_zero_remembers_nothing() -> None:
    cache = StateCache(capacity=10)
    cache.put(LockState("a", version=3))
    cache.forget("a")
    cache.forget("never-seen")
    assert cache.get("a") is None
    off = StateCache(capacity=0)
    off.put(LockState("a", version=1))
    assert off.get("a") is None
    assert len(off) == 0


@given(
    st.integers(min_value=1, max_value=8),
    st.lists(st.tuples(st.sampled_from("abcdefghij"), st.booleans()), max_size=80),
)
def test_the_cache_holds_exactly_the_latest_state_of_the_most_recent_resources(
    capacity: int, operations: list[tuple[str, bool]]
) -> None:
    """Against a model: an ordered list of (resource, version), put moves a resource to the end."""
    cache = StateCache(capacity)
    model: list[tuple[str, int]] = []
    for step, (resource, forget) in enumerate(operations):
        model = [(r, v) for r, v in model if r != resource]
        if forget:
            cache.forget(resource)
        else:
            cache.put(LockState(resource, version=step))
            model = [*model, (resource, step)][-capacity:]
        assert len(cache) == len(model)
        for r, v in model:
            state = cache.get(r)
            assert state is not None
            assert state.version == v


def test_the_guess_holds_while_it_succeeds_and_stops_while_it_fails() -> None:
    guess = NewStreamGuess(weight=0.1, probe_every=4)
    assert guess.should_guess()
    for _ in range(10):
        guess.record(held=False)
    assert guess.rate < 0.5
    # While failing it still probes one unknown stream in four, so it can learn that things changed.
    assert [guess.should_guess() for _ in range(8)] == [False, False, False, True] * 2
    for _ in range(20):
        guess.record(held=True)
    assert guess.rate >= 0.5
    assert all(guess.should_guess() for _ in range(5))
