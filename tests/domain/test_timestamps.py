"""The one shape of an instant in answers: RFC 3339 in UTC, six fractional digits, ``Z``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.timestamps import TIMESTAMP_PATTERN, format_timestamp


def test_an_instant_in_another_offset_is_written_in_utc() -> None:
    paris = timezone(timedelta(hours=2))
    assert format_timestamp(datetime(2026, 5, 5, 11, 30, tzinfo=paris)) == "2026-05-05T09:30:00.000000Z"


def test_a_naive_datetime_is_refused() -> None:
    with pytest.raises(ValueError, match="naive"):
        format_timestamp(datetime(2026, 5, 5, 9, 30))


@given(
    st.datetimes(timezones=st.timezones(), min_value=datetime(1000, 1, 2), max_value=datetime(9999, 12, 30))
)
def test_it_round_trips_and_has_the_one_shape(instant: datetime) -> None:
    written = format_timestamp(instant)
    assert re.fullmatch(TIMESTAMP_PATTERN, written)
    assert datetime.fromisoformat(written) == instant.astimezone(UTC)
