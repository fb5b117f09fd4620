"""``python -m bench.hostile``: does a server stay responsive while clients misbehave?

Two kinds of phase alternate on one server (authentication on, as in production), each ``--duration``
seconds, ``--rounds`` times (idle, hostile, idle, hostile, ...), so that both see the same machine:

- **idle**: a probe alone, plus a steady flow of lock events (``--event-rate`` acquire/release cycles per
  second on random resources), so the change feed has something to send.
- **hostile**: the same, plus ``--stalled-readers`` change-feed clients (a dashboard's token) that never
  read (each socket's receive buffer is shrunk to 4 KiB, so the server's writes block soon), replaced as
  soon as the server cuts one; and ``--hangups`` authenticated acquires per second whose client hangs up
  half-way through the body.

The probe sends ``GET /healthz`` and an acquire (then its release) of its own lock, paced every
``--probe-interval`` seconds, and records each answer's latency. The figure is each hostile phase's p99
against the idle phases' (the pooled samples of each kind), for ``/healthz`` and the acquire; the target is a
ratio under 2. The run also counts what the server logged in each phase (lines, tracebacks) and checks that
no token it was sent appears anywhere in its log.

Output: a table on stdout and JSON lines in ``bench/results/hostile-<time>.jsonl`` (one object per phase,
then a summary). The exit status is 1 when a token appears in the server's log or a probe request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import select
import shlex
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from rich.console import Console
from rich.table import Table

from bench.auth import bearer
from bench.database import provision
from bench.environment import environment as machine_environment
from bench.output import RESULTS_DIR, JsonLines, default_path
from bench.server import LockledgerServer
from bench.stats import latency_ms
from domain.access import Role
from eventstore.dburl import asyncpg_dsn
from service import tokens

TARGET_RATIO = 2.0
_RECEIVE_BUFFER = 4096
_HANGUP_BODY = b'{"ttl_ms": 5000, "wait_ms": 0}' + b" " * 200  # Content-Length counts all of it


@dataclass
class Phase:
    """What one phase measured."""

    kind: str  # idle or hostile
    healthz: list[float] = field(default_factory=list)
    acquire: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    readers_opened: int = 0
    readers_cut: int = 0
    hangups: int = 0
    log_lines: int = 0
    log_tracebacks: int = 0

    def record(self, index: int) -> dict[str, Any]:
        return {
            "kind": "phase", "phase": index, "type": self.kind,
            "healthz": latency_ms(self.healthz), "acquire": latency_ms(self.acquire),
            "failures": len(self.failures), "first_failure": self.failures[0] if self.failures else None,
            "readers_opened": self.readers_opened, "readers_cut": self.readers_cut, "hangups": self.hangups,
            "log_lines": self.log_lines, "log_tracebacks": self.log_tracebacks,
        }  # fmt: skip


@dataclass(frozen=True)
class Tokens:
    agent: str  # the probe's, the event flow's and the hang-ups'
    dashboard: str  # the stalled feed readers'

    def all(self) -> tuple[str, ...]:
        return (self.agent, self.dashboard)


async def mint(database_url: str, run: str) -> Tokens:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        agent = await tokens.create(conn, f"hostile-{run}-agent", Role.AGENT)
        dashboard = await tokens.create(conn, f"hostile-{run}-dashboard", Role.DASHBOARD)
    finally:
        await conn.close()
    return Tokens(agent, dashboard)


# --- the probe and the event flow ------------------------------------------------------------------------


async def probe(session: aiohttp.ClientSession, phase: Phase, interval: float, stop: asyncio.Event) -> None:
    """``/healthz``, then an acquire and release of the probe's own lock, every ``interval`` seconds."""
    resource = f"hostile-probe-{uuid.uuid4().hex[:8]}"
    next_at = time.perf_counter()
    while not stop.is_set():
        try:
            started = time.perf_counter()
            async with session.get("/healthz") as response:
                await response.read()
                if response.status != 200:
                    phase.failures.append(f"/healthz: {response.status}")
            phase.healthz.append(time.perf_counter() - started)
            started = time.perf_counter()
            async with session.post(f"/v1/locks/{resource}/acquire", json={"ttl_ms": 5000}) as response:
                body = await response.json()
            if response.status in (200, 201):
                phase.acquire.append(time.perf_counter() - started)
                release = {"fencing_token": body["fencing_token"]}
                async with session.post(f"/v1/locks/{resource}/release", json=release) as response:
                    await response.read()
            else:
                phase.failures.append(f"acquire: {response.status} {body}")
        except (aiohttp.ClientError, TimeoutError) as error:
            phase.failures.append(repr(error))
        next_at += interval
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))


async def event_flow(session: aiohttp.ClientSession, rate: float, stop: asyncio.Event) -> None:
    """Acquire and release random locks, ``rate`` cycles per second (their events feed the change feed)."""
    rng = random.Random(7)
    next_at = time.perf_counter()
    while not stop.is_set():
        resource = f"hostile-flow-{rng.randrange(10_000)}"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.post(f"/v1/locks/{resource}/acquire", json={"ttl_ms": 5000}) as response:
                body = await response.json()
            if response.status in (200, 201):
                release = {"fencing_token": body["fencing_token"]}
                async with session.post(f"/v1/locks/{resource}/release", json=release) as response:
                    await response.read()
        next_at += 1 / rate
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))


# --- the hostile clients -----------------------------------------------------------------------------------


def _request(method: str, path: str, token: str, extra: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {bearer(token)}\r\n{extra}\r\n"
    ).encode()


async def _stalled_reader(port: int, token: str) -> socket.socket:
    """A change-feed subscription whose socket is never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(
        sock, _request("GET", "/v1/events/stream", token, "Accept: text/event-stream\r\n")
    )
    return sock


def _cut(sock: socket.socket) -> bool:
    """Whether the server has closed or reset the connection (without reading what it sent)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


async def stalled_readers(port: int, token: str, count: int, phase: Phase, stop: asyncio.Event) -> None:
    """Keep ``count`` readers that never read connected; one the server cuts is replaced."""
    readers: list[socket.socket] = []
    try:
        while not stop.is_set():
            for sock in [s for s in readers if _cut(s)]:
                readers.remove(sock)
                sock.close()
                phase.readers_cut += 1
            while len(readers) < count:
                readers.append(await _stalled_reader(port, token))
                phase.readers_opened += 1
            await asyncio.sleep(0.2)
    finally:
        for sock in readers:
            sock.close()


async def hangups(port: int, token: str, rate: float, phase: Phase, stop: asyncio.Event) -> None:
    """``rate`` acquires per second whose client sends half the body, then hangs up."""
    head = _request(
        "POST",
        "/v1/locks/hostile-hangup/acquire",
        token,
        f"Content-Type: application/json\r\nContent-Length: {len(_HANGUP_BODY)}\r\n",
    )
    next_at = time.perf_counter()
    while not stop.is_set():
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + _HANGUP_BODY[: len(_HANGUP_BODY) // 2])
            await writer.drain()
            await asyncio.sleep(0.01)  # the server has begun reading the body
            writer.transport.abort()
            phase.hangups += 1
        next_at += 1 / rate
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))


# --- a run -------------------------------------------------------------------------------------------------


async def run_phase(server: LockledgerServer, toks: Tokens, kind: str, options: argparse.Namespace) -> Phase:
    phase = Phase(kind)
    stop = asyncio.Event()
    headers = {"Authorization": bearer(toks.agent)}
    timeout = aiohttp.ClientTimeout(total=30)
    log_before = server.log_path.read_bytes()
    async with (
        aiohttp.ClientSession(server.base_url, headers=headers, timeout=timeout) as probing,
        aiohttp.ClientSession(server.base_url, headers=headers, timeout=timeout) as flowing,
    ):
        tasks = [
            asyncio.create_task(probe(probing, phase, options.probe_interval, stop)),
            asyncio.create_task(event_flow(flowing, options.event_rate, stop)),
        ]
        if kind == "hostile":
            tasks.append(
                asyncio.create_task(
                    stalled_readers(server.port, toks.dashboard, options.stalled_readers, phase, stop)
                )
            )
            tasks.append(asyncio.create_task(hangups(server.port, toks.agent, options.hangups, phase, stop)))
        await asyncio.sleep(options.duration)
        stop.set()
        await asyncio.gather(*tasks)
    await asyncio.sleep(0.5)  # what the phase made the server log, written out
    logged = server.log_path.read_bytes()[len(log_before) :].decode(errors="replace")
    phase.log_lines = len(logged.splitlines())
    phase.log_tracebacks = logged.count("Traceback (most recent call last)")
    return phase


def ratios(phases: list[Phase]) -> dict[str, float | None]:
    """Each measure's hostile p99 over its idle p99 (the pooled samples of each kind)."""
    found: dict[str, float | None] = {}
    for measure in ("healthz", "acquire"):
        p99 = {}
        for kind in ("idle", "hostile"):
            samples = [s for p in phases if p.kind == kind for s in getattr(p, measure)]
            p99[kind] = latency_ms(samples)["p99_ms"]
        idle, hostile = p99["idle"], p99["hostile"]
        found[f"{measure}_p99_ratio"] = round(hostile / idle, 2) if idle and hostile is not None else None
    return found


def print_report(console: Console, phases: list[Phase], total: dict[str, Any]) -> None:
    table = Table(title="Latency while clients misbehave (ms)")
    for column in ("phase", "healthz p50", "healthz p99", "acquire p50", "acquire p99", "readers cut",
                   "hang-ups", "log lines", "tracebacks", "failed"):  # fmt: skip
        table.add_column(column, justify="right")
    for index, phase in enumerate(phases):
        h, a = latency_ms(phase.healthz), latency_ms(phase.acquire)
        table.add_row(
            f"{index} {phase.kind}", str(h["p50_ms"]), str(h["p99_ms"]), str(a["p50_ms"]), str(a["p99_ms"]),
            str(phase.readers_cut), str(phase.hangups), str(phase.log_lines), str(phase.log_tracebacks),
            str(len(phase.failures)),
        )  # fmt: skip
    console.print(table)
    for measure in ("healthz", "acquire"):
        ratio = total[f"{measure}_p99_ratio"]
        verdict = "n/a" if ratio is None else ("holds" if ratio < TARGET_RATIO else "MISSED")
        console.print(f"{measure} p99 hostile/idle: {ratio} (target < {TARGET_RATIO}: {verdict})")
    console.print(f"tokens found in the server's log: {total['tokens_in_log']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="idle+hostile pairs, interleaved (default 2)")
    p.add_argument("--stalled-readers", type=int, default=20, help="feed readers that never read (20)")
    p.add_argument("--hangups", type=float, default=20.0, help="mid-body hang-ups per second (20)")
    p.add_argument("--event-rate", type=float, default=50.0, help="background cycles per second (50)")
    p.add_argument("--probe-interval", type=float, default=0.02, help="seconds between probes (0.02)")
    p.add_argument(
        "--write-timeout", type=float, default=5.0,
        help="the server's LOCKLEDGER_HTTP_WRITE_TIMEOUT_S, so stalled readers are cut within a phase (5)",
    )  # fmt: skip
    p.add_argument(
        "--database-url", help="a PostgreSQL server to make a fresh database on (default: embedded)"
    )
    p.add_argument("--out", type=Path, help="JSON lines file (default: bench/results/hostile-<time>.jsonl)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    out = JsonLines(options.out or default_path("hostile-", RESULTS_DIR))
    db = provision(options.database_url)
    server = LockledgerServer(
        db.url, workers=1, env={"LOCKLEDGER_HTTP_WRITE_TIMEOUT_S": str(options.write_timeout)}
    )
    try:
        out.write(
            {
                "kind": "environment",
                "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
                "command": shlex.join([Path(sys.executable).name, "-m", "bench.hostile", *sys.argv[1:]]),
                **machine_environment(),
                "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()},
            }
        )
        server.start()
        toks = asyncio.run(mint(db.url, uuid.uuid4().hex[:8]))
        phases: list[Phase] = []
        for _ in range(options.rounds):
            for kind in ("idle", "hostile"):
                console.print(f"phase {len(phases)}: {kind}, {options.duration:g} s")
                phase = asyncio.run(run_phase(server, toks, kind, options))
                phases.append(phase)
                out.write(phase.record(len(phases) - 1))
        log = server.log_path.read_text(errors="replace")
        total: dict[str, Any] = {
            "kind": "summary",
            **ratios(phases),
            "target_ratio": TARGET_RATIO,
            "tokens_in_log": sum(log.count(token) for token in toks.all()),
            "probe_failures": sum(len(p.failures) for p in phases),
        }
        out.write(total)
        print_report(console, phases, total)
    finally:
        server.stop()
        db.close()
    console.print(f"results: {out.path}")
    console.print(f"server log: {server.log_path}")
    return 1 if total["tokens_in_log"] or total["probe_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
