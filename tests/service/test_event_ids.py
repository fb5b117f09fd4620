"""The appender's event ids: version-7 UUIDs (time first), a batch's worth from one read of the random
source."""

from __future__ import annotations

import itertools
import os
import time
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eventstore.event_ids import new_event_ids


def _unix_ms(parsed: uuid.UUID) -> int:
    return parsed.int >> 80


@given(st.integers(min_value=0, max_value=300))
def test_each_id_is_a_version_7_uuid_in_32_hex_digits_stamped_now(count: int) -> None:
    before_ms = time.time_ns() // 1_000_000
    ids = new_event_ids(count)
    after_ms = time.time_ns() // 1_000_000
    assert len(ids) == count
    for text in ids:
        assert len(text) == 32
        parsed = uuid.UUID(hex=text)
        assert parsed.version == 7
        assert parsed.variant == uuid.RFC_4122
        assert parsed.hex == text
        assert before_ms <= _unix_ms(parsed) <= after_ms


def test_ids_do_not_repeat() -> None:
    ids = [i for _ in range(20) for i in new_event_ids(500)]
    assert len(set(ids)) == len(ids) == 10_000


def test_a_later_batch_sorts_after_an_earlier_one() -> None:
    """What keeps the unique index's inserts on its last pages: ids grow with the clock (the 12 bits after
    the millisecond hold its fraction, so batches within one millisecond keep their order too, while the
    clock does)."""
    batches = [new_event_ids(4) for _ in range(200)]
    for earlier, later in itertools.pairwise(batches):
        assert max(earlier)[:16] <= min(later)[:16]


def test_a_batch_reads_the_random_source_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real_urandom = os.urandom

    def urandom(size: int) -> bytes:
        reads.append(size)
        return real_urandom(size)

    monkeypatch.setattr(os, "urandom", urandom)
    new_event_ids(64)
    assert reads == [8 * 64]


@pytest.mark.parametrize(("fill", "random_half"), [(0xFF, "bfffffffffffffff"), (0x00, "8000000000000000")])
def test_the_layout_is_time_version_fraction_variant_random(
    monkeypatch: pytest.MonkeyPatch, fill: int, random_half: str
) -> None:
    """Bits 0-47 the millisecond, 48-51 the version, 52-63 the millisecond's fraction, then the variant,
    then 62 bits of the random source untouched: all ones stay ones, all zeros zeros."""
    instant_ns = 1_764_633_600_123_456_789  # 2025-12-02T00:00:00.123456789Z
    monkeypatch.setattr(os, "urandom", lambda size: bytes([fill]) * size)
    monkeypatch.setattr(time, "time_ns", lambda: instant_ns)
    ms, within_ns = divmod(instant_ns, 1_000_000)
    fraction = within_ns * 4096 // 1_000_000
    expected = f"{ms:012x}7{fraction:03x}{random_half}"
    assert new_event_ids(2) == [expected, expected]
    assert _unix_ms(uuid.UUID(hex=expected)) == ms
