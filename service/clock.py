"""The clocks an in-process store serializes its decisions by (the ``Clock`` port, ``service/ports.py``).

PostgreSQL reads ``clock_timestamp()`` inside the statement that serializes a decision, so its adapters
take no clock. The in-memory fakes read one of these: the wall clock when the server runs without a
database, a settable clock in tests, where time passes only when the test says so.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class SystemClock:
    """This machine's clock, in UTC."""

    def now(self) -> datetime:
        return datetime.now(UTC)


class SettableClock:
    """A clock that stands still until it is set or advanced: tests decide when leases lapse."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start if start is not None else datetime(2026, 5, 5, 9, 30, tzinfo=UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not run backwards")
        self._now += timedelta(seconds=seconds)
