"""The use cases' tests run on the in-memory fakes: a clock the test sets, and a database on it."""

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
