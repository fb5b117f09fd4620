"""``python -m bench.statement_cost``: the commit statement's PostgreSQL CPU per command, per schema variant.

What is checked is what the figures rest on: every stretch committed what it says (acquires granted,
releases accepted, every command's event, lock state and Idempotency-Key written), each variant's
database really differs from the shipped one in the part its name says it takes away (and only there),
and the summary's differences are computed from the medians. No figure is held to a value.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from bench import statement_cost
from bench.database import provision
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import verify_chains

pytestmark = pytest.mark.storage


@dataclass
class Found:
    events: int
    keys: int
    held: int
    types: set[str]
    chain_ok: bool
    indexes: set[str]


async def _inspect(url: str) -> Found:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return Found(
            events=await conn.fetchval("SELECT count(*) FROM events"),
            keys=await conn.fetchval("SELECT count(*) FROM idempotency_keys"),
            held=await conn.fetchval("SELECT count(*) FROM lock_state WHERE status = 'held'"),
            types={r[0] for r in await conn.fetch("SELECT DISTINCT event_type FROM events")},
            chain_ok=(await verify_chains(conn)).ok,
            indexes={r[0] for r in await conn.fetch("SELECT indexname FROM pg_indexes")},
        )
    finally:
        await conn.close()


def test_each_variant_commits_every_command_and_differs_only_where_named(database_url: str) -> None:
    database = provision(database_url)
    try:
        names = ["shipped", "no-chain-trigger", "no-lock-state-indexes"]
        variants = statement_cost.make_variants(database, names, seed=3)
        stretches = asyncio.run(statement_cost.measure(variants, [1, 6], commands=36, rounds=2, out=None))
        seen = {
            name: asyncio.run(_inspect(variant.url)) for name, variant in zip(names, variants, strict=True)
        }
    finally:
        database.close()

    assert len(stretches) == len(names) * 2 * 2
    assert all(s["commands"] >= 36 and s["backend_cpu_us_per_command"] > 0 for s in stretches)
    for name, found in seen.items():
        # every command appended one event and kept its key; every acquire was released
        commands = sum(s["commands"] for s in stretches if s["variant"] == name)
        assert found.events == found.keys >= commands, name
        assert found.types == {"LOCK_ACQUIRED", "LOCK_RELEASED"}, name
        assert found.held == 0, name
    # one seed: each variant drew the same resources, so the same number of events
    assert len({found.events for found in seen.values()}) == 1
    assert seen["shipped"].chain_ok
    assert seen["no-lock-state-indexes"].chain_ok
    assert not seen["no-chain-trigger"].chain_ok  # the trigger did not run: no hashes
    assert seen["no-chain-trigger"].indexes == seen["shipped"].indexes
    assert seen["shipped"].indexes - seen["no-lock-state-indexes"].indexes == {
        "lock_state_owner_idx",
        "lock_state_expires_at_idx",
        "lock_state_resource_prefix_idx",
    }


def test_the_summary_takes_medians_and_a_saving_from_the_rounds_differences() -> None:
    runs = [
        ("shipped", 1, 70.0),
        ("shipped", 2, 90.0),
        ("shipped", 3, 75.0),
        ("bare", 1, 50.0),
        ("bare", 2, 54.0),
    ]
    stretches = [
        {
            "variant": v,
            "batch": 4,
            "round": n,
            "backend_cpu_us_per_command": cpu,
            "wall_us_per_command": cpu * 2,
        }
        for v, n, cpu in runs
    ]
    rows = {row["variant"]: row for row in statement_cost.summarize(stretches)}
    assert rows["shipped"]["backend_cpu_us_per_command"] == 75.0
    assert rows["shipped"]["backend_cpu_us_range"] == [70.0, 90.0]
    assert "saves_us_per_command" not in rows["shipped"]
    assert rows["bare"]["backend_cpu_us_per_command"] == 52.0
    # round 1: 70 - 50, round 2: 90 - 54; not the difference of the medians (75 - 52)
    assert rows["bare"]["saves_us_per_command"] == 28.0
    assert rows["bare"]["saves_us_range"] == [20.0, 36.0]


def test_the_command_writes_stretches_and_a_summary(database_url: str, tmp_path: Path) -> None:
    out = tmp_path / "cost.jsonl"
    argv = ["--variants", "shipped", "--batches", "3", "--commands", "12", "--rounds", "1"]
    assert statement_cost.main([*argv, "--database-url", database_url, "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["type"] for r in records] == ["stretch", "summary"]
    assert records[0]["variant"] == "shipped"
    assert records[0]["batch"] == 3
    summary = records[1]
    assert summary["rows"][0]["backend_cpu_us_per_command"] == round(
        records[0]["backend_cpu_us_per_command"], 1
    )
    assert "server_version" not in summary["environment"]["postgresql"]
    assert summary["environment"]["postgresql"]["postgresql"]


@pytest.mark.parametrize(
    "argv",
    [["--variants", "shipped,faster"], ["--variants", ""], ["--commands", "0"], ["--batches", "0"]],
)
def test_bad_options_are_refused_before_anything_runs(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        statement_cost.main(argv)
    assert refused.value.code == 2
