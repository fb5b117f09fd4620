"""The use cases depend on ports only (``service/ports.py``, docs/decisions/0042): no pool, no SQL, no
PostgreSQL adapter, so the in-memory fakes can stand in for the database. Read from the source with
``ast``, as the layering test does; ``service/composition.py`` is where the adapters are chosen."""

from __future__ import annotations

import pytest

from tests.structure.test_layering import ROOT, imports

USE_CASES = [
    "service/lock_service.py",
    "service/waiters.py",
    "service/saga_service.py",
    "service/saga_lapse.py",
    "service/shared_lock_service.py",
]
# What only a PostgreSQL adapter may import: the driver, the pool and statements, the adapters themselves.
POSTGRES = {
    "asyncpg",
    "eventstore",
    "service.database",
    "service.lock_store",
    "service.store",
    "service.saga_store",
    "service.shared_lock_store",
    "service.reaper_store",
    "service.notifier",
    "service.composition",
}
FAKES = ["service/fakes/" + path.name for path in sorted((ROOT / "service" / "fakes").glob("*.py"))]


def _postgres_imports(path: str) -> list[str]:
    return [
        f"{path}:{line} imports {name}"
        for line, name in imports(ROOT / path)
        if any(name == forbidden or name.startswith(forbidden + ".") for forbidden in POSTGRES)
    ]


@pytest.mark.parametrize("path", USE_CASES + FAKES)
def test_use_cases_and_fakes_import_no_postgresql(path: str) -> None:
    assert not _postgres_imports(path), "\n".join(_postgres_imports(path))


def test_the_reaper_takes_its_store_as_a_port() -> None:
    """The reaper still names asyncpg's errors (its outage watch is PostgreSQL's), but no statement,
    pool or adapter."""
    wrong = [found for found in _postgres_imports("service/reaper.py") if not found.endswith(" asyncpg")]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_postgresql_import() -> None:
    assert _postgres_imports("service/store.py")  # the adapter itself imports asyncpg
