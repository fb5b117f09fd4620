"""``@value`` records (domain/value.py): dataclasses that compare and hash by their fields, and that the
type checker keeps frozen."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from domain.commands import Acquire
from domain.events import LockAcquired
from domain.state import LockState

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = datetime(2026, 12, 1, tzinfo=UTC)


def test_records_compare_and_hash_by_their_fields() -> None:
    held = LockState("zone-A3", 1, "held", "bot-1", 1, 30_000, DEADLINE)
    same = LockState("zone-A3", 1, "held", "bot-1", 1, 30_000, DEADLINE)
    assert held == same
    assert hash(held) == hash(same)
    assert len({held, same, LockState("zone-A3")}) == 2
    assert Acquire("r", "bot-1", 1_000) != Acquire("r", "bot-2", 1_000)
    # Every field counts, the fencing token too.
    assert LockAcquired("r", "bot-1", 1, 30_000, DEADLINE) != LockAcquired("r", "bot-1", 2, 30_000, DEADLINE)


def test_records_are_slotted_and_changed_by_copy() -> None:
    state = LockState("zone-A3")
    assert not hasattr(state, "__dict__")
    moved = dataclasses.replace(state, version=2, status="held")
    assert (state.version, state.status) == (0, "free")
    assert (moved.version, moved.status) == (2, "held")


def test_the_type_checker_refuses_to_change_a_record(tmp_path: Path) -> None:
    """What frozen dataclasses enforced at run time, mypy (run in CI) enforces before it."""
    snippet = tmp_path / "mutates.py"
    snippet.write_text(
        "from domain.state import LockState\n"
        "from domain.commands import Acquire\n"
        "state = LockState('zone-A3')\n"
        "state.version = 3\n"
        "Acquire('r', 'bot-1', 1_000).ttl_ms = 5\n"
    )
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(snippet)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert 'Property "version" defined in "LockState" is read-only' in checked.stdout
    assert 'Property "ttl_ms" defined in "Acquire" is read-only' in checked.stdout
