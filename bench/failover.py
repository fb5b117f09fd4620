"""``python -m bench.failover``: what a fleet sees when the primary dies, and what the cluster costs.

Two parts, on one local Patroni cluster (``eventstore.cluster``, as ``lockledger cluster up``: three
PostgreSQL nodes, synchronous mode strict, one etcd) and one lockledger server on its multi-host URL:

- **kills**: ``--agents`` agents each hold a lease of their own (``--ttl-ms``), renew it every third of
  its TTL, and now and then release it and acquire again. Every command carries an Idempotency-Key and is
  retried under it while the answer is unknown (503, a broken connection, a timeout), as the SDK does.
  ``--kills`` times, the leader's Patroni and postmaster are killed with SIGKILL (the host dies); the
  cluster elects a new leader, then the dead node is started again and rejoins as a replica. Per kill:
  the write outage the clients saw (first failed command after the kill to the first success after it).
  At the end, from the new primary's log: acknowledged commands missing (must be 0), leases lapsed
  (``LOCK_EXPIRED`` or a 410 to a renew; the agents never let a lease go, so must be 0) and extensions
  after an outage.
- **cost**: acquire+release cycles in a closed loop by ``--workers`` agents on distinct locks, against
  the cluster and against one embedded PostgreSQL, interleaved ``--rounds`` times; throughput and p99,
  and their ratios cluster / single.

Output: a table on stdout and JSON lines in ``bench/results/failover-<time>.jsonl``. The exit status is
1 when an acknowledged command is missing or a lease lapsed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from rich.console import Console
from rich.table import Table

from bench.auth import agent_names, bearer, mint_agent_tokens
from bench.database import provision
from bench.environment import environment as machine_environment
from bench.output import JsonLines, default_path
from bench.server import LockledgerServer
from bench.stats import latency_ms
from eventstore.cluster import ClusterError, LocalCluster
from eventstore.dburl import asyncpg_dsn
from migrations.upgrade import upgrade

_UNKNOWN = {500, 502, 503, 504}


@dataclass
class Drill:
    """What the agents saw during the kills."""

    acked_keys: set[str] = field(default_factory=set)
    failures: list[float] = field(default_factory=list)  # monotonic instants of failed attempts
    successes: list[float] = field(default_factory=list)
    lapsed_answers: int = 0  # 410 lease_expired to a renew or release
    refused: dict[int, int] = field(default_factory=dict)

    def outage_after(self, killed_at: float) -> float | None:
        """Seconds from the first failure at or after ``killed_at`` to the first success after it."""
        first_failure = next((t for t in self.failures if t >= killed_at), None)
        if first_failure is None:
            return 0.0  # nobody noticed
        first_success = next((t for t in self.successes if t > first_failure), None)
        return None if first_success is None else first_success - first_failure


class Agent:
    """One agent holding a lease of its own, renewing it, releasing and acquiring again now and then."""

    def __init__(
        self, http: aiohttp.ClientSession, owner: str, token: str, ttl_ms: int, drill: Drill
    ) -> None:
        self._http = http
        self._headers = {"Authorization": bearer(token)}
        self._owner = owner
        self._resource = f"{owner}:lease"
        self._ttl_ms = ttl_ms
        self._drill = drill

    async def _command(self, verb: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The command until a definite answer, under one key; the body of a 2xx, None otherwise."""
        key = uuid.uuid4().hex
        headers = {**self._headers, "Idempotency-Key": key}
        while True:
            try:
                async with self._http.post(
                    f"/v1/locks/{self._resource}/{verb}", json=body, headers=headers
                ) as response:
                    status = response.status
                    answer = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError):
                status, answer = 0, None
            now = time.monotonic()
            if 200 <= status < 300:
                self._drill.successes.append(now)
                self._drill.acked_keys.add(key)
                return dict(answer)
            if status == 0 or status in _UNKNOWN:
                self._drill.failures.append(now)
                await asyncio.sleep(0.2)
                continue
            self._drill.refused[status] = self._drill.refused.get(status, 0) + 1
            if status == 410:
                self._drill.lapsed_answers += 1
            return None

    async def run(self, stop: asyncio.Event) -> None:
        owner = self._owner
        while not stop.is_set():
            lease = await self._command("acquire", {"owner": owner, "ttl_ms": self._ttl_ms})
            if lease is None:
                await asyncio.sleep(0.5)
                continue
            body = {"owner": owner, "fencing_token": lease["fencing_token"]}
            for _ in range(random.randint(3, 12)):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._ttl_ms / 3000)
                if stop.is_set() or await self._command("renew", body) is None:
                    break
            await self._command("release", body)


def _kill_leader(cluster: LocalCluster) -> str:
    """SIGKILL the leader's Patroni and postmaster, as if its host died; its name."""
    leader = cluster.status().leader
    assert leader is not None, "no leader to kill"
    for pid in (cluster.patroni_pid(leader), cluster.postmaster_pid(leader)):
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return leader


def _wait_new_leader(cluster: LocalCluster, victim: str, timeout: float = 120.0) -> None:
    """Until another node leads with a synchronous standby (etcd keeps the dead leader's key until its
    TTL runs out, so the cluster looks ready, under the dead leader, for a while)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ClusterError):
            state = cluster.status()
            if state.leader not in (None, victim) and state.ready():
                return
        time.sleep(0.5)
    raise ClusterError(f"no new leader within {timeout:.0f} s of killing {victim}")


async def _log_audit(url: str, prefix: str, keys: set[str]) -> dict[str, int]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await conn.fetch(
            "SELECT event_type, metadata->>'idempotency_key' AS key, metadata->>'command' AS command"
            " FROM events WHERE stream_id LIKE $1",
            prefix + "%",
        )
    finally:
        await conn.close()
    logged = {r["key"] for r in rows if r["key"] is not None}
    return {
        "events": len(rows),
        "acked_missing": len(keys - logged),
        "expired": sum(r["event_type"] == "LOCK_EXPIRED" for r in rows),
        "extended": sum(r["command"] == "extend" for r in rows),
    }


async def drill(
    args: argparse.Namespace, cluster: LocalCluster, server: LockledgerServer, url: str
) -> dict[str, Any]:
    prefix = f"failover-{uuid.uuid4().hex[:6]}:"
    owners = agent_names(prefix, args.agents)
    minted = await mint_agent_tokens(url, owners)
    state = Drill()
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=10)
    outages: list[float | None] = []
    async with aiohttp.ClientSession(base_url=server.base_url, timeout=timeout) as http:
        agents = [
            Agent(http, owner, token, args.ttl_ms, state) for owner, token in zip(owners, minted, strict=True)
        ]
        tasks = [asyncio.create_task(agent.run(stop)) for agent in agents]
        await asyncio.sleep(args.settle_s)
        for kill in range(1, args.kills + 1):
            killed_at = time.monotonic()
            victim = await asyncio.to_thread(_kill_leader, cluster)
            await asyncio.to_thread(_wait_new_leader, cluster, victim)
            await asyncio.sleep(args.settle_s)  # writes flow again before the node comes back
            await asyncio.to_thread(cluster.up, 3, 1, None, timeout=180.0)  # the dead node rejoins
            outage = state.outage_after(killed_at)
            outages.append(outage)
            shown = "no success yet" if outage is None else f"{outage:.1f} s"
            print(f"kill {kill}/{args.kills}: {victim}; clients' write outage {shown}", flush=True)
            await asyncio.sleep(args.settle_s)
        stop.set()
        await asyncio.gather(*tasks)
    audit = await _log_audit(url, prefix, state.acked_keys)
    seen = [o for o in outages if o is not None]
    return {
        "kind": "kills",
        "kills": args.kills,
        "agents": args.agents,
        "ttl_ms": args.ttl_ms,
        "outage_s": [None if o is None else round(o, 2) for o in outages],
        "outage_p50_s": round(statistics.median(seen), 2) if seen else None,
        "outage_max_s": round(max(seen), 2) if seen else None,
        "acked": len(state.acked_keys),
        "refused": state.refused,
        "lapsed": audit["expired"] + state.lapsed_answers,
        **audit,
    }


async def _cycles(base_url: str, agents: list[tuple[str, str]], seconds: float) -> dict[str, Any]:
    """Closed-loop acquire+release by each (owner, token) on a lock of its own for ``seconds``: cycles
    per second and latency."""
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds

    async def worker(http: aiohttp.ClientSession, owner: str, token: str) -> None:
        nonlocal errors
        headers = {"Authorization": bearer(token)}
        resource = f"{owner}:lock"
        while time.monotonic() < deadline:
            started = time.perf_counter()
            async with http.post(
                f"/v1/locks/{resource}/acquire", json={"owner": owner, "ttl_ms": 30_000}, headers=headers
            ) as acquired:
                lease = await acquired.json(content_type=None)
            if acquired.status != 201:
                errors += 1
                continue
            body = {"owner": owner, "fencing_token": lease["fencing_token"]}
            async with http.post(f"/v1/locks/{resource}/release", json=body, headers=headers) as released:
                await released.read()
            if released.status != 200:
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)

    connector = aiohttp.TCPConnector(limit=len(agents))
    async with aiohttp.ClientSession(base_url=base_url, connector=connector) as http:
        await asyncio.gather(*(worker(http, owner, token) for owner, token in agents))
    return {"cycles_per_s": round(len(latencies) / seconds, 1), **latency_ms(latencies), "errors": errors}


async def cost(
    args: argparse.Namespace, targets: dict[str, tuple[LockledgerServer, str]]
) -> list[dict[str, Any]]:
    """Interleaved rounds of the closed loop on each target."""
    agents = {}
    for name, (_, url) in targets.items():
        owners = agent_names(f"cost-{name}-{uuid.uuid4().hex[:6]}-", args.workers)
        agents[name] = list(zip(owners, await mint_agent_tokens(url, owners), strict=True))
    records = []
    for round_ in range(1, args.rounds + 1):
        for name, (server, _) in targets.items():
            await _cycles(server.base_url, agents[name], 1.0)  # warm-up
            result = await _cycles(server.base_url, agents[name], args.duration)
            records.append({"kind": "cost", "round": round_, "target": name, **result})
            shown = f"{result['cycles_per_s']} cycles/s, p99 {result['p99_ms']} ms"
            print(f"round {round_} {name}: {shown}", flush=True)
    return records


def _median(records: list[dict[str, Any]], target: str, field_: str) -> float:
    return float(
        statistics.median(r[field_] for r in records if r["target"] == target and r[field_] is not None)
    )


def report(kills: dict[str, Any], costs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "kind": "summary",
        "outage_p50_s": kills["outage_p50_s"],
        "outage_max_s": kills["outage_max_s"],
        "acked_missing": kills["acked_missing"],
        "lapsed": kills["lapsed"],
        "extended": kills["extended"],
    }
    if costs:
        for target in ("single", "cluster"):
            summary[f"{target}_cycles_per_s"] = _median(costs, target, "cycles_per_s")
            summary[f"{target}_p99_ms"] = _median(costs, target, "p99_ms")
        summary["throughput_ratio"] = round(
            summary["cluster_cycles_per_s"] / summary["single_cycles_per_s"], 3
        )
        summary["p99_ratio"] = round(summary["cluster_p99_ms"] / summary["single_p99_ms"], 3)
    table = Table(title="failover and cluster cost")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key != "kind":
            table.add_row(key, str(value))
    Console().print(table)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="leader kills (default 10)")
    parser.add_argument("--agents", type=int, default=32, help="agents holding a lease each (default 32)")
    parser.add_argument("--ttl-ms", type=int, default=5_000, help="their leases' TTL (default 5000)")
    parser.add_argument("--settle-s", type=float, default=3.0, help="pause around each kill (default 3)")
    parser.add_argument("--workers", type=int, default=32, help="agents in the cost loop (default 32)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per cost cell (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved cost rounds (default 3; 0 skips)")
    parser.add_argument("--output", type=Path, default=None, help="JSON lines file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    output = JsonLines(args.output or default_path("failover-"))
    output.write({"kind": "environment", **machine_environment(), "args": vars(args) | {"output": None}})
    directory = Path(tempfile.mkdtemp(prefix="lockledger-failover-"))
    directory.chmod(0o755)  # the cluster's processes run as the embedded server's user when root
    cluster = LocalCluster(directory / "cluster")
    single = None
    servers: list[LockledgerServer] = []
    try:
        cluster.up(3, 1)
        url = cluster.create_database()
        upgrade(url)
        server = LockledgerServer(url, 1, env={"LOCKLEDGER_READ_DATABASE_URL": cluster.read_dsn()})
        server.start()
        servers.append(server)
        kills = asyncio.run(drill(args, cluster, server, url))
        output.write(kills)
        costs: list[dict[str, Any]] = []
        if args.rounds > 0:
            single = provision(None)
            alone = LockledgerServer(single.url, 1)
            alone.start()
            servers.append(alone)
            costs = asyncio.run(cost(args, {"single": (alone, single.url), "cluster": (server, url)}))
            for record in costs:
                output.write(record)
        summary = report(kills, costs)
        output.write(summary)
        print(f"results: {output.path}")
        return 1 if kills["acked_missing"] or kills["lapsed"] else 0
    finally:
        for running in servers:
            running.stop()
        if single is not None:
            single.close()
        cluster.down(purge=True)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
