"""``python -m bench.history`` end to end on a small history: loaded and kept once, then measured again as
it is with ``--loaded``, which leaves the projection's checkpoint as it found it."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime
from pathlib import Path

import asyncpg
import pytest

from bench.history import main
from eventstore.dburl import asyncpg_dsn
from tests.databases import run_admin

pytestmark = [pytest.mark.storage, pytest.mark.slow]

SMALL = ["--agents", "20", "--resources", "200", "--state-samples", "3", "--history-samples", "3"]


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _covered(url: str) -> list[tuple[str, datetime | None]]:
    """Each projection's checkpoint: how far replay may read it."""

    async def read() -> list[tuple[str, datetime | None]]:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            rows = await conn.fetch("SELECT name, covered_until FROM projector_checkpoints ORDER BY name")
        finally:
            await conn.close()
        return [(row["name"], row["covered_until"]) for row in rows]

    return asyncio.run(read())


def test_a_kept_history_is_measured_again_as_it_is(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first.jsonl"
    assert (
        main(["--events", "3000", *SMALL, "--database-url", database_url, "--keep", "--out", str(first)]) == 0
    )
    printed = capsys.readouterr().out
    found = re.search(r"kept: --loaded (\S+)", printed)
    assert found is not None, printed
    kept = found.group(1)
    try:
        covered = _covered(kept)
        assert all(until is not None for _, until in covered), covered
        again = tmp_path / "again.jsonl"
        assert main(["--loaded", kept, *SMALL, "--out", str(again)]) == 0
        (loaded,) = [r for r in _records(first) if r["kind"] == "history"]
        (measured,) = [r for r in _records(again) if r["kind"] == "history"]
        assert (loaded["events"], measured["events"]) == (3000, 3000)
        assert measured["load"] is None
        assert loaded["load"] is not None
        for record in (loaded, measured):
            state = record["state"]
            assert isinstance(state, dict)
            assert state["errors"] == 0
            assert state["locks_mean"] is not None
        after = dict(_covered(kept))  # the pass from the log put the checkpoints back (or the server's
        for name, until in covered:  # projectors moved them on)
            moved = after[name]
            assert moved is not None
            assert until is not None
            assert moved >= until
    finally:
        run_admin(
            database_url, f'DROP DATABASE IF EXISTS "{kept.rsplit("/", 1)[1].split("?")[0]}" WITH (FORCE)'
        )
