"""The instants a client sends (``at``, ``from``, ``to``): RFC 3339 with an offset, refused (422) when UTC
cannot write them (before year 1 or after 9999) or when they are finer than a microsecond; and the SDK's
helper (``lockledger.replay.instant``) refuses exactly what the server refuses, and sends the same instant.
The same rules over HTTP: ``tests/replay/test_replay_http.py``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import TypeAdapter
from pydantic import ValidationError as ModelError

from api.models import Instant
from domain.timestamps import format_timestamp
from lockledger.errors import ValidationError as SdkError
from lockledger.replay import instant

INSTANT = TypeAdapter(Instant)
_MAX_US = (datetime.max - datetime.min) // timedelta(microseconds=1)


def server(text: str) -> str | None:
    """The instant as the server reads it (in the one answer shape), None if refused."""
    try:
        return format_timestamp(INSTANT.validate_python(text))
    except ModelError:
        return None


def sdk(text: str) -> str | None:
    try:
        return instant("at", text)
    except SdkError as error:
        refused = error
    assert refused.status == 0  # refused before anything is sent
    return None


def _two(n: int) -> str:
    return f"{n:02d}"


_YEARS = st.one_of(st.integers(1, 2), st.integers(9998, 9999), st.integers(1, 9999))
_OFFSETS = st.one_of(
    st.sampled_from(["Z", "z", "+00:00", "-00:00"]),
    st.tuples(st.sampled_from("+-"), st.integers(0, 23), st.integers(0, 59)).map(
        lambda o: f"{o[0]}{_two(o[1])}:{_two(o[2])}"
    ),
)
_FRACTIONS = st.one_of(
    st.none(),
    st.text("0123456789", min_size=1, max_size=12),
    st.tuples(st.text("0123456789", min_size=6, max_size=6), st.integers(1, 30)).map(
        lambda f: f[0] + "0" * f[1]
    ),
)


@st.composite
def rfc3339(draw: st.DrawFn) -> str:
    year, month = draw(_YEARS), draw(st.integers(1, 12))
    day = draw(st.sampled_from([1, 2, 28, 31])) if month in (1, 12) else draw(st.integers(1, 28))
    clock = ":".join(_two(draw(st.integers(0, top))) for top in (23, 59, 59))
    fraction = draw(_FRACTIONS)
    tail = "" if fraction is None else "." + fraction
    return f"{year:04d}-{_two(month)}-{_two(day)}{draw(st.sampled_from('Tt '))}{clock}{tail}{draw(_OFFSETS)}"


_PARTS = re.compile(r"(?P<local>.{19})(?:\.(?P<fraction>[0-9]+))?(?P<offset>.+)")


def expected(text: str) -> str | None:
    """Computed by hand: the local time less the offset, in microseconds since 0001-01-01T00:00Z."""
    parts = _PARTS.fullmatch(text)
    assert parts is not None
    local, fraction, offset = parts["local"], parts["fraction"] or "", parts["offset"]
    if fraction[6:].strip("0"):
        return None
    naive = datetime.fromisoformat(local[:10] + "T" + local[11:])
    since_min = (naive - datetime.min) // timedelta(microseconds=1) + int((fraction + "000000")[:6])
    if offset not in ("Z", "z"):
        sign = -1 if offset[0] == "-" else 1
        since_min -= sign * (int(offset[1:3]) * 60 + int(offset[4:6])) * 60 * 1_000_000
    if not 0 <= since_min <= _MAX_US:
        return None
    return format_timestamp((datetime.min + timedelta(microseconds=since_min)).replace(tzinfo=UTC))


@given(rfc3339())
@example("0001-01-01T00:00:00+14:00")
@example("0001-01-01T00:00:00+00:01")
@example("0001-01-01T00:00:00-00:01")
@example("9999-12-31T23:59:59.999999Z")
@example("9999-12-31T23:59:59-00:01")
@example("9999-12-31T23:00:00+23:59")
@example("2026-05-05T09:30:00.1234567Z")
@example("2026-05-05T09:30:00.1234560000000Z")
def test_the_server_and_the_sdk_take_exactly_the_instants_utc_writes_to_the_microsecond(text: str) -> None:
    want = expected(text)
    assert server(text) == want
    assert sdk(text) == want


@pytest.mark.parametrize(
    ("text", "written"),
    [
        ("0001-01-01T00:00:00Z", "0001-01-01T00:00:00.000000Z"),
        ("0001-01-01T14:00:00+14:00", "0001-01-01T00:00:00.000000Z"),
        ("9999-12-31T23:59:59.999999Z", "9999-12-31T23:59:59.999999Z"),
        ("9999-12-31T09:59:59.999999-14:00", "9999-12-31T23:59:59.999999Z"),
        ("2026-05-05T09:30:00.250000000Z", "2026-05-05T09:30:00.250000Z"),
    ],
)
def test_the_edges_utc_can_write_are_taken(text: str, written: str) -> None:
    assert server(text) == sdk(text) == written


@pytest.mark.parametrize(
    "text",
    [
        "0001-01-01T00:00:00+14:00",
        "0001-01-01T00:00:00+00:01",
        "0001-01-01T13:59:59.999999+14:00",
        "9999-12-31T23:59:59-00:01",
        "9999-12-31T10:00:00-14:00",
        "2026-05-05T09:30:00.1234567Z",
        "2026-05-05T09:30:00.0000001Z",
        "2026-05-05T09:30:00.9999999Z",
        "\u0662\u0660\u0662\u0666-05-05T09:30:00Z",  # Arabic-Indic digits are digits to Python's re
    ],
)
def test_instants_utc_cannot_write_or_finer_than_a_microsecond_are_refused(text: str) -> None:
    assert server(text) is None
    assert sdk(text) is None


def test_the_server_takes_no_line_break_after_an_instant() -> None:
    assert server("2026-05-05T09:30:00Z\n") is None  # a regex's $ would have let it through


def test_an_aware_datetime_outside_utcs_years_is_refused_by_the_sdk() -> None:
    with pytest.raises(SdkError, match="outside years 1 to 9999"):
        instant("at", datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1))))
    with pytest.raises(SdkError, match="outside years 1 to 9999"):
        instant("at", datetime.max.replace(tzinfo=timezone(-timedelta(minutes=1))))
