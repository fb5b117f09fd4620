"""The in-memory fakes the use-case tests run on: a settable clock and the database the fakes share."""

from __future__ import annotations

import pytest

from service.clock import SettableClock
from service.fakes.database import MemoryDatabase


@pytest.fixture
def clock() -> SettableClock:
    return SettableClock()


@pytest.fixture
def database(clock: SettableClock) -> MemoryDatabase:
    return MemoryDatabase(clock)
