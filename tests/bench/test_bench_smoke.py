"""The benchmark, end to end in quick mode with very short cells: every target measures something,
nothing fails, the hot mode finds no safety violation, and the JSON lines file holds what it promises.
The bench's server runs with authentication on, and its agents get through with their own tokens."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from bench.auth import AUTH, agent_names, mint_agent_tokens
from bench.config import BenchConfig, quick_config
from bench.database import RECORDED_SETTINGS
from bench.http_client import CLIENT_KINDS, make_client
from bench.output import read
from bench.runner import run
from bench.server import LockledgerServer
from bench.targets.redis_lock import redis_answers

pytestmark = [pytest.mark.storage, pytest.mark.slow]

CELL_KEYS = {
    "type", "target", "mode", "resources", "workers", "server_workers", "renews", "duration_s",
    "cycles", "cycles_per_s", "conflicts", "conflicts_per_s", "requests", "errors", "error_samples",
    "latency_ms", "server_cpu_pct", "server_peak_rss_mb", "pg_cpu_pct", "loadgen_cpu_pct",
    "loadgen_cpu_ms_per_request", "other_cpu_pct", "violations", "safety", "http_client", "inside_server",
    "server_cpu_us_per_request",
}  # fmt: skip
SUMMARY_KEYS = {"type", "ratios", "goals", "errors", "violations", "notes", "environment", "config"}
ENVIRONMENT_KEYS = {"cpu_count", "python", "postgresql", "git_commit", "http_client", "auth", "agent_tokens"}


def _targets() -> tuple[str, ...]:
    targets = ["lockledger", "noop", "raw-sql"]
    if importlib.util.find_spec("eventsourcing") and importlib.util.find_spec("psycopg"):
        targets.append("eventsourcing")
    if asyncio.run(redis_answers(BenchConfig().redis_url)) is not None:
        targets.append("redis")
    return tuple(targets)


def test_quick_bench_measures_every_target_without_errors(database_url: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    config = quick_config(
        BenchConfig(targets=_targets(), database_url=database_url, out=out, duration_s=0.8, warmup_s=0.3)
    )
    path, cells, _summary = run(config, Console(stderr=True, quiet=True))

    assert path == out
    expected = {(t, m) for t in config.targets for m in ("uniform", "hot")}
    assert {(c["target"], c["mode"]) for c in cells} == expected
    for cell in cells:
        where = f"{cell['target']} {cell['mode']}"
        assert cell["workers"] == 4, where
        assert cell["cycles"] > 0, where
        assert cell["errors"] == 0, (where, cell["error_samples"])
        assert cell["latency_ms"]["acquire"]["n"] > 0, where
        # Every cell starts from a vacuumed, analyzed, checkpointed database (the embedded server's
        # superuser may do both).
        assert cell["settled"]["done"] == ["VACUUM (ANALYZE)", "CHECKPOINT"], where
        assert cell["settled"]["seconds"] >= 0, where
        if cell["mode"] == "hot" and cell["target"] != "noop":
            assert cell["violations"] == 0, (where, cell["safety"])
            assert cell["safety"]["grants_checked"] >= cell["cycles"], where
        if cell["target"] in ("lockledger", "noop"):
            assert cell["server_cpu_pct"] is not None, where
            # The server's CPU per request is its CPU over the window, shared out over the requests.
            per_request_s = cell["server_cpu_pct"] / 100 * cell["duration_s"] / cell["requests"]
            assert cell["server_cpu_us_per_request"] == pytest.approx(per_request_s * 1e6, rel=0.05), where
            assert cell["server_peak_rss_mb"] > 0, where
            assert cell["http_client"] in ("httptools", "aiohttp"), where
            assert cell["target_config"]["auth"] == AUTH, where
            # The server's own view of the window: the lock commands went to the database in batches,
            # the no-op twin never did; both show the event loop's lag.
            inside = cell["inside_server"]
            assert inside["loop_lag_ms"]["wakeups"] > 0, where
            if cell["target"] == "lockledger":
                assert inside["commit"]["commands_per_batch"] >= 1, where
                assert inside["commit"]["batch_ms"] > 0, where
            else:
                assert inside["commit"] is None, where
                assert inside["load"] is None, where

    records = read(out)
    assert [r["type"] for r in records] == ["cell"] * len(cells) + ["summary"]
    for record in records[:-1]:
        assert record.keys() >= CELL_KEYS
    last = records[-1]
    assert last.keys() >= SUMMARY_KEYS
    assert last["environment"].keys() >= ENVIRONMENT_KEYS
    assert last["errors"] == 0
    assert last["violations"] == 0
    assert {(r["mode"], r["workers"]) for r in last["ratios"]} == {("uniform", 4), ("hot", 4)}
    assert last["environment"]["postgresql"]["postgresql"]
    assert last["environment"]["postgresql"].keys() >= set(RECORDED_SETTINGS)
    assert last["environment"]["auth"] == "bearer"
    assert last["environment"]["agent_tokens"] == 4
    assert any("authentication on" in note for note in last["notes"])


def test_the_bench_server_wants_a_token_and_each_agent_sends_its_own(database_url: str) -> None:
    server = LockledgerServer(database_url, workers=1)
    server.start()  # refuses to come up unless a command without a token gets 401
    try:
        assert server.anonymous_status() == 401

        async def owners(kind: str, names: list[str]) -> list[str]:
            """The owner of a lease each of ``names``' agents takes without naming one in the body."""
            client = make_client(kind, server.host, server.port, timeout_s=10)
            await client.open(await mint_agent_tokens(database_url, names))
            try:
                seen = []
                for i in range(len(names)):
                    path = f"/v1/locks/bench-auth-{uuid.uuid4().hex[:8]}/acquire"
                    body = json.dumps({"ttl_ms": 5_000}).encode()
                    status, reply = await client.connection(i).post(path, body, uuid.uuid4().hex)
                    assert status == 201, reply
                    seen.append(json.loads(reply)["owner"])
                return seen
            finally:
                await client.close()

        for kind in CLIENT_KINDS:
            names = agent_names(f"test-{uuid.uuid4().hex[:8]}-", 2)
            assert asyncio.run(owners(kind, names)) == names, kind
    finally:
        server.stop()


def test_waiting_acquires_on_hot_locks_take_turns_instead_of_conflicting(
    database_url: str, tmp_path: Path
) -> None:
    """``--wait-ms``: 16 agents on 8 hot locks, every acquire waiting up to 5 s. The server hands each
    lock to its waiters as it comes free, so no acquire is refused, and the safety checker still finds
    one holder at a time and tokens that only rise."""
    config = BenchConfig(
        targets=("lockledger",),
        workers=(16,),
        modes=("hot",),
        database_url=database_url,
        out=tmp_path / "bench.jsonl",
        duration_s=1.0,
        warmup_s=0.3,
        wait_ms=5_000,
    )
    _path, cells, summary = run(config, Console(stderr=True, quiet=True))
    (cell,) = cells
    assert cell["target_config"]["acquire_wait_ms"] == 5_000
    assert cell["cycles"] > 0
    assert cell["errors"] == 0, cell["error_samples"]
    assert cell["conflicts"] == 0
    assert cell["violations"] == 0, cell["safety"]
    assert cell["safety"]["grants_checked"] >= cell["cycles"]
    assert summary["violations"] == 0


def test_bench_without_its_extra_says_what_to_install() -> None:
    hide_redis = (
        "import runpy, sys; sys.modules['redis'] = None; runpy.run_module('bench', run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", hide_redis], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert "python -m bench needs the bench extra (redis not installed)" in result.stderr
    assert "Traceback" not in result.stderr
