"""What PostgreSQL spends on a command: the server's commit statement alone, without HTTP or the server.

The HTTP bench's cycles/s move 15 to 25 % between runs on this machine, so a change worth 5 % on the
database's side cannot be seen there. A backend's own CPU time over a fixed stream of statements moves
much less, because it counts only the time the backend ran, however long it waited for a core. So this
bench drives ``service.lock_store.commit_many``, the very statement the server sends for a batch of
commands, over one connection, and reads that connection's backend CPU time from
``/proc/<pid>/schedstat`` (nanoseconds) around each stretch.

Each *variant* is a database of its own in one cluster, migrated as shipped and then changed by a few
statements: the shipped schema, and diagnostics that take one part away (the hash-chain trigger, a group
of secondary indexes) so that the difference says what that part costs each command. The diagnostics
break promises the design makes (an intact hash chain, the dashboards' indexes) and exist only to be
measured. For every batch size, a stretch commits acquire batches on resources drawn uniformly from
100,000 (as the bench's uniform mode does) and then the batches releasing them, each command with an
Idempotency-Key, so every command appends its event, its idempotency record and its ``lock_state`` row.
Variants and batch sizes take turns, round after round, so a drift of the machine's speed falls on all
of them alike; each figure is the median over the rounds.

    python -m bench.statement_cost                          # every variant, batches of 1, 8 and 30
    python -m bench.statement_cost --variants shipped --batches 1,30 --rounds 6
    python -m bench.statement_cost --database-url postgresql://postgres@127.0.0.1:5432/postgres

It needs PostgreSQL on this machine (embedded by default), since it reads the backend's ``/proc`` entry.
Prints a table and writes JSON lines to ``bench/results/statement-cost-<timestamp>.jsonl``: one
``"stretch"`` object per stretch, then a ``"summary"`` with the medians and the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from rich.console import Console
from rich.table import Table

from bench.cli import int_list, name_list, positive_int
from bench.database import BenchDatabase, execute, provision
from bench.environment import environment
from bench.output import RESULTS_DIR, JsonLines
from domain.commands import Acquire, Command, Release
from domain.decider import decide
from domain.resource import TtlBounds
from domain.state import LockState, initial_state
from eventstore.dburl import asyncpg_dsn
from eventstore.schema import SERVICE_ROLE
from migrations.upgrade import upgrade
from service import lock_store
from service.database import COMMAND_PATH_SETTINGS
from service.idempotency import fingerprint
from service.lock_service import append_plan
from service.ports import AppendPlan, Committed, Idempotency

RESOURCES = 100_000
OWNER = "statement-cost-agent"
BOUNDS = TtlBounds()
# What each diagnostic takes away from a freshly migrated database (run as its owner).
_PARTS: dict[str, tuple[str, ...]] = {
    "no-chain-trigger": (
        "ALTER TABLE events ALTER COLUMN hash SET DEFAULT ''::bytea",  # the column stays NOT NULL
        "ALTER TABLE events DISABLE TRIGGER events_chain_hash",
    ),
    "no-lock-state-indexes": (
        "DROP INDEX lock_state_owner_idx",
        "DROP INDEX lock_state_expires_at_idx",
        "DROP INDEX lock_state_resource_prefix_idx",
    ),
    "no-time-indexes": ("DROP INDEX events_recorded_at_idx", "DROP INDEX idempotency_keys_created_at_idx"),
    "no-event-id-index": ("ALTER TABLE events DROP CONSTRAINT events_event_id_key",),
}
# "shipped" is the schema as migrated; "bare" takes every part away at once.
VARIANTS: dict[str, tuple[str, ...]] = {
    "shipped": (),
    **_PARTS,
    "bare": tuple(statement for part in _PARTS.values() for statement in part),
}


def backend_cpu_s(pid: int) -> float:
    """Seconds the process has run on a CPU (the first field of schedstat, in nanoseconds)."""
    with open(f"/proc/{pid}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e9


@dataclass
class Variant:
    """One database and what has been committed in it: the states the next commands decide on."""

    name: str
    url: str
    rng: random.Random
    states: dict[str, LockState] = field(default_factory=dict)


def _plan(command: Command, state: LockState, fields: dict[str, Any]) -> AppendPlan:
    name = type(command).__name__.lower()
    key = uuid.uuid4().hex
    events = decide(state, command, datetime.now(UTC), BOUNDS)
    plan = append_plan(
        command,
        state,
        events,
        {"command": name, "actor": OWNER, "idempotency_key": key},
        Idempotency(OWNER, key, fingerprint(name, command.resource, fields)),
    )
    assert plan is not None
    return plan


def acquire_plans(variant: Variant, batch: int) -> list[AppendPlan]:
    """Acquires of ``batch`` distinct free locks, drawn uniformly (a batch never holds a resource twice)."""
    chosen: set[str] = set()
    while len(chosen) < batch:
        chosen.add(f"cost:{variant.rng.randrange(RESOURCES)}")
    return [
        _plan(Acquire(r, OWNER, BOUNDS.default_ms), variant.states.get(r) or initial_state(r),
              {"owner": OWNER, "ttl_ms": BOUNDS.default_ms})
        for r in sorted(chosen)
    ]  # fmt: skip


def release_plans(granted: list[tuple[AppendPlan, Committed]]) -> list[AppendPlan]:
    plans = []
    for plan, committed in granted:
        state = plan.new_state.with_deadline(committed.expires_at)
        token = state.fencing_token
        fields = {"owner": OWNER, "fencing_token": token}
        plans.append(_plan(Release(state.resource, OWNER, token), state, fields))
    return plans


async def stretch(conn: asyncpg.Connection, variant: Variant, batch: int, commands: int) -> dict[str, Any]:
    """Commit about ``commands`` commands in batches of ``batch``: acquires, then their releases."""
    pid = conn.get_server_pid()
    done = 0
    cpu0, wall0 = backend_cpu_s(pid), time.perf_counter()
    while done < commands:
        plans = acquire_plans(variant, batch)
        results = await lock_store.commit_many(conn, plans)
        if any(result is None for result in results):
            raise RuntimeError(f"{variant.name}: an acquire of a free lock was refused")
        granted = [(plan, result) for plan, result in zip(plans, results, strict=True) if result is not None]
        releases = release_plans(granted)
        results = await lock_store.commit_many(conn, releases)
        if any(result is None for result in results):
            raise RuntimeError(f"{variant.name}: a release of a live lease was refused")
        for plan in releases:
            variant.states[plan.new_state.resource] = plan.new_state
        done += len(plans) + len(releases)
    cpu1, wall1 = backend_cpu_s(pid), time.perf_counter()
    return {
        "variant": variant.name,
        "batch": batch,
        "commands": done,
        "backend_cpu_us_per_command": round((cpu1 - cpu0) / done * 1e6, 2),
        "wall_us_per_command": round((wall1 - wall0) / done * 1e6, 2),
    }


async def _connect(url: str) -> asyncpg.Connection:
    """A session as the server's command path opens one: the service role, UTC, its planner settings."""
    settings = {"timezone": "UTC", "role": SERVICE_ROLE, **COMMAND_PATH_SETTINGS}
    return await asyncpg.connect(asyncpg_dsn(url), server_settings=settings)


def make_variants(database: BenchDatabase, names: Sequence[str], seed: int) -> list[Variant]:
    """A database per variant beside the provisioned one, migrated and then changed as the variant says.
    Every variant draws the same resources in the same order (one seed)."""
    variants = []
    for name in names:
        url = database.sibling(name.replace("-", "_"))
        upgrade(url)
        if VARIANTS[name]:
            asyncio.run(execute(url, *VARIANTS[name]))
        variants.append(Variant(name, url, random.Random(seed)))
    return variants


async def measure(
    variants: list[Variant], batches: Sequence[int], commands: int, rounds: int, out: JsonLines | None
) -> list[dict[str, Any]]:
    conns = {variant.name: await _connect(variant.url) for variant in variants}
    try:
        for variant in variants:  # warm-up: plans cached, the first pages of every index made
            await stretch(conns[variant.name], variant, max(batches), min(commands, 600))
        stretches = []
        for number in range(rounds):
            order = variants if number % 2 == 0 else variants[::-1]
            for batch in batches:
                for variant in order:
                    record = await stretch(conns[variant.name], variant, batch, commands)
                    record.update(type="stretch", round=number + 1)
                    stretches.append(record)
                    if out is not None:
                        out.write(record)
                    print(
                        f"round {number + 1}/{rounds}  batch {batch:>3}  {variant.name:<22}"
                        f"  {record['backend_cpu_us_per_command']:7.1f} µs of PostgreSQL CPU per command",
                        flush=True,
                    )
        return stretches
    finally:
        for conn in conns.values():
            await conn.close()


def summarize(stretches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant and batch size: the medians over the rounds and, for a diagnostic, what it saves.

    The saving is the median of the round-by-round differences from ``shipped`` (the two stretches ran
    next to each other, so a drift of the machine's speed between rounds cancels), not the difference
    of the two medians."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in stretches:
        groups.setdefault((record["variant"], record["batch"]), []).append(record)
    shipped = {
        (r["batch"], r.get("round")): r["backend_cpu_us_per_command"]
        for r in stretches
        if r["variant"] == "shipped"
    }
    rows = []
    for (name, batch), records in groups.items():
        cpu = [r["backend_cpu_us_per_command"] for r in records]
        row = {
            "variant": name, "batch": batch, "rounds": len(records),
            "backend_cpu_us_per_command": round(statistics.median(cpu), 1),
            "backend_cpu_us_range": [min(cpu), max(cpu)],
            "wall_us_per_command": round(statistics.median(r["wall_us_per_command"] for r in records), 1),
        }  # fmt: skip
        paired = [
            shipped[batch, r.get("round")] - r["backend_cpu_us_per_command"]
            for r in records
            if (batch, r.get("round")) in shipped
        ]
        if name != "shipped" and paired:
            row["saves_us_per_command"] = round(statistics.median(paired), 1)
            row["saves_us_range"] = [round(min(paired), 1), round(max(paired), 1)]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> Table:
    result = Table(
        title=(
            "PostgreSQL's CPU per command of the commit statement (medians over the rounds; a diagnostic's"
            " saving: the median of its differences from shipped, round by round)"
        ),
        title_justify="left",
    )
    for name in ("variant", "batch", "PG CPU µs/cmd", "range", "wall µs/cmd", "saves µs/cmd", "range "):
        result.add_column(name, justify="left" if name == "variant" else "right", no_wrap=True)
    for row in rows:
        low, high = row["backend_cpu_us_range"]
        cpu, wall = row["backend_cpu_us_per_command"], row["wall_us_per_command"]
        saves, spread = "-", "-"
        if "saves_us_per_command" in row:
            saves = f"{row['saves_us_per_command']:.1f}"
            spread = "{:.0f} to {:.0f}".format(*row["saves_us_range"])
        result.add_row(
            row["variant"],
            str(row["batch"]),
            f"{cpu:.1f}",
            f"{low:.0f}-{high:.0f}",
            f"{wall:.0f}",
            saves,
            spread,
        )
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.statement_cost", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants",
        type=name_list(tuple(VARIANTS)),
        default=tuple(VARIANTS),
        help=f"comma-separated, from {','.join(VARIANTS)} (default: all)",
    )
    p.add_argument("--batches", type=int_list, default=[1, 8, 30], help="commands per statement (1,8,30)")
    p.add_argument(
        "--commands", type=positive_int, default=1_200, help="commands per stretch (default: 1,200)"
    )
    p.add_argument(
        "--rounds", type=positive_int, default=10, help="stretches per variant and batch size (default: 10)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--database-url", default=None, help="a PostgreSQL server on this machine (default: embedded)"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="JSON lines (default: bench/results/statement-cost-*)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out_path = args.out or RESULTS_DIR / f"statement-cost-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    print(f"provisioning PostgreSQL ({'external' if args.database_url else 'embedded'})", flush=True)
    database = provision(args.database_url)
    try:
        if database.postgres_pid is None:
            raise SystemExit(
                "PostgreSQL's processes are not visible here: this bench reads their /proc entries"
            )
        variants = make_variants(database, args.variants, args.seed)
        out = JsonLines(out_path)
        stretches = asyncio.run(measure(variants, args.batches, args.commands, args.rounds, out))
        rows = summarize(stretches)
        out.write(
            {"type": "summary", "rows": rows, "environment": {**environment(), "postgresql": database.info}}
        )
    finally:
        database.close()
    Console(width=max(100, Console().width)).print(table(rows))
    print(f"results: {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
