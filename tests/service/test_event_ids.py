"""The appender's event ids: random version-4 UUIDs, a batch's worth from one read of the random source."""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eventstore.event_ids import new_event_ids


@given(st.integers(min_value=0, max_value=300))
def test_each_id_is_a_version_4_uuid_in_32_hex_digits(count: int) -> None:
    ids = new_event_ids(count)
    assert len(ids) == count
    for text in ids:
        assert len(text) == 32
        parsed = uuid.UUID(hex=text)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert parsed.hex == text


def test_ids_do_not_repeat() -> None:
    ids = [i for _ in range(20) for i in new_event_ids(500)]
    assert len(set(ids)) == len(ids) == 10_000


def test_a_batch_reads_the_random_source_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real_urandom = os.urandom

    def urandom(size: int) -> bytes:
        reads.append(size)
        return real_urandom(size)

    monkeypatch.setattr(os, "urandom", urandom)
    new_event_ids(64)
    assert reads == [16 * 64]


@pytest.mark.parametrize(
    ("fill", "expected"),
    [(0xFF, "ffffffffffff4fffbfffffffffffffff"), (0x00, "00000000000040008000000000000000")],
)
def test_only_the_version_and_variant_bits_are_set(
    monkeypatch: pytest.MonkeyPatch, fill: int, expected: str
) -> None:
    """The other 122 bits are the random source's, untouched: all ones stay ones, all zeros zeros."""
    monkeypatch.setattr(os, "urandom", lambda size: bytes([fill]) * size)
    assert new_event_ids(2) == [expected, expected]
