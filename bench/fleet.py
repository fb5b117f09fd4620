"""Fleet scale: heartbeats and the reaper.

Two scenarios against a real `lockledger serve` subprocess (reaper on, as in production):

``heartbeats``
    A agents (10,000) each take one lease (`fleet:hb:<run>:<i>`, ttl 30 s), then renew it every 10 s
    for D seconds (60), their first renews spread evenly over one interval (about A/10 renews/s), then
    release. Every renew must answer 200; a 409/410 is a lost lease. Afterwards the log must hold no
    LOCK_EXPIRED on any of those streams (no spurious expiry).

``lapse``
    L leases (100,000) on `fleet:lapse:<run>:<i>` are acquired with a TTL chosen so that all of them lapse
    after the creation finishes, and are left to lapse, while a probe of 16 agents keeps doing
    acquire/release cycles on other resources. When every lease is expired, the expiry lateness
    (``recorded_at`` of LOCK_EXPIRED minus the deadline it carries) is computed from the events table.
    Targets: every lease expired within 10 s of its deadline, lateness p99 < 1 s, no probe error.

Authentication is on, as in production (``LOCKLEDGER_DEV_MODE=false``): before each scenario its agents'
API tokens are minted in one statement (``service.tokens.create_many``; 10,000 take well under a second)
and every request carries its agent's ``Authorization: Bearer``; the token's name owns the lease, so
bodies name no owner. Heartbeats: one token per agent. Lapse: one token per creation slot
(``--concurrency``, each slot an agent taking many leases; the calibration uses the same ones, so it
measures the same rate) and one per probe agent.

Resource and token names carry a run id, so a database may be reused and several runs never mix.

    python -m bench.fleet                      # both scenarios, default sizes, embedded PostgreSQL
    python -m bench.fleet --quick              # 500 agents x 15 s, 5,000 leases
    python -m bench.fleet --scenario lapse --leases 20000 --server-workers 2
    python -m bench.fleet --scenario lapse --lapse-deadlines cluster   # every deadline at one instant

Prints a table and writes JSON lines to ``bench/results/fleet-<timestamp>.jsonl``. Exit status 1 when a
target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import socket
import sys
import tempfile
import time
import uuid
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import psutil
from rich.console import Console
from rich.table import Table

from bench.auth import AUTH, agent_names, bearer, mint_agent_tokens
from bench.collector import quiet_gc
from bench.database import provision, server_settings
from bench.environment import environment as machine_environment
from lockledger.dburl import asyncpg_dsn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TTL_MIN_MS = 1_000
TTL_MAX_MS = 3_600_000
LATENESS_LIMIT_S = 10.0  # every lease expired within 10 s of its deadline
LATENESS_P99_LIMIT_S = 1.0
OTHER_LOAD_WARNING_PCT = 15.0  # CPU % (of one core) used by processes outside the run: results disturbed

# --- parameters -----------------------------------------------------------------------------------------


@dataclass
class HeartbeatParams:
    agents: int = 10_000
    duration_s: float = 60.0
    interval_s: float = 10.0
    ttl_ms: int = 30_000
    concurrency: int = 256  # requests in flight while acquiring and releasing (and HTTP connections)


@dataclass
class LapseParams:
    leases: int = 100_000
    concurrency: int = 256
    ttl_ms: int | None = None  # None: calibrated so that the first deadline falls after creation
    # spread: one TTL for all, so deadlines come at the creation rate; cluster: all at one instant
    deadlines: str = "spread"
    margin_s: float = 15.0  # slack between the estimated end of creation and the first deadline
    calibration: int = 1_000  # acquires (1 s leases on fleet:calib:*) that measure the creation rate
    probe_agents: int = 16
    probe_rate: float = 0.0  # acquire+release cycles/s of the whole probe; 0: closed loop
    probe_baseline_s: float = 3.0  # probe alone before creation, for a reference latency
    expiry_timeout_s: float = 120.0  # give up this long after the last deadline
    poll_interval_s: float = 1.0


@dataclass
class FleetOptions:
    scenarios: tuple[str, ...] = ("heartbeats", "lapse")
    heartbeats: HeartbeatParams = field(default_factory=HeartbeatParams)
    lapse: LapseParams = field(default_factory=LapseParams)
    server_workers: int = 1
    reaper_interval_ms: int = 200
    reaper_batch_size: int = 1_000
    server_env: dict[str, str] = field(default_factory=dict)
    server_log_level: str = "warning"
    output_dir: Path | None = RESULTS_DIR  # None: write nothing
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


# --- statistics ------------------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values (None when empty)."""
    if not sorted_values:
        return None
    rank = math.ceil(q / 100 * len(sorted_values))
    return sorted_values[min(max(rank, 1), len(sorted_values)) - 1]


def latency_summary(seconds: Iterable[float]) -> dict[str, Any]:
    """count, p50/p95/p99/max in milliseconds."""
    values = sorted(seconds)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 2)

    return {
        "count": len(values),
        "p50_ms": ms(percentile(values, 50)),
        "p95_ms": ms(percentile(values, 95)),
        "p99_ms": ms(percentile(values, 99)),
        "max_ms": ms(values[-1] if values else None),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _statuses(counter: Counter[int]) -> dict[str, int]:
    return {str(status): count for status, count in sorted(counter.items())}


# --- process monitoring ----------------------------------------------------------------------------------


class ProcessTreeMonitor:
    """CPU seconds and RSS of a process (and, if ``recursive``, its descendants), by sampling."""

    def __init__(self, pid: int, *, recursive: bool = True) -> None:
        self._root = psutil.Process(pid)
        self._recursive = recursive
        self._cpu_s: dict[int, float] = {}  # last seen user+system seconds per pid (the dead keep theirs)

    def sample(self) -> tuple[float, int, int]:
        """(total CPU seconds so far, RSS of the tree, largest single RSS) now."""
        processes = [self._root]
        if self._recursive:
            with contextlib.suppress(psutil.Error):
                processes += self._root.children(recursive=True)
        rss_total = rss_max = 0
        for process in processes:
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    rss = process.memory_info().rss
            except psutil.Error:
                continue
            self._cpu_s[process.pid] = times.user + times.system
            rss_total += rss
            rss_max = max(rss_max, rss)
        return sum(self._cpu_s.values()), rss_total, rss_max

    def per_process(self) -> dict[int, float]:
        """CPU seconds per pid as of the last sample."""
        return dict(self._cpu_s)


class MachineMonitor:
    """The whole machine: busy CPU seconds (all cores) and memory in use, to expose other load."""

    def sample(self) -> tuple[float, int, int]:
        times = psutil.cpu_times()
        busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
        used = psutil.virtual_memory().used
        return busy, used, used

    def per_process(self) -> dict[int, float]:
        return {}


@dataclass
class Sample:
    wall: float
    cpu_s: dict[str, float]
    rss: dict[str, int]
    rss_single: dict[str, int]
    per_process: dict[str, dict[int, float]]


class Sampler:
    """Samples several process trees every ``period_s``; phase figures come from pairs of snapshots."""

    def __init__(
        self, monitors: dict[str, ProcessTreeMonitor | MachineMonitor], period_s: float = 0.5
    ) -> None:
        self._monitors = monitors
        self._period_s = period_s
        self._samples: list[Sample] = []
        self._task: asyncio.Task[None] | None = None

    def snapshot(self) -> Sample:
        cpu: dict[str, float] = {}
        rss: dict[str, int] = {}
        single: dict[str, int] = {}
        per_process: dict[str, dict[int, float]] = {}
        for name, monitor in self._monitors.items():
            cpu[name], rss[name], single[name] = monitor.sample()
            per_process[name] = monitor.per_process()
        sample = Sample(time.time(), cpu, rss, single, per_process)
        self._samples.append(sample)
        return sample

    async def _run(self) -> None:
        while True:
            self.snapshot()
            await asyncio.sleep(self._period_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def stats(self, start: Sample, end: Sample) -> dict[str, Any]:
        """CPU % (100 = one core) and peak RSS (MB) of each monitored tree between two snapshots."""
        elapsed = max(end.wall - start.wall, 1e-9)
        window = [s for s in self._samples if start.wall <= s.wall <= end.wall] or [end]
        out: dict[str, Any] = {"window_s": round(elapsed, 2)}
        for name in self._monitors:
            out[name] = {
                "cpu_pct": round((end.cpu_s[name] - start.cpu_s[name]) / elapsed * 100, 1),
                "peak_rss_mb": round(max(s.rss[name] for s in window) / 2**20, 1),
                "peak_process_rss_mb": round(max(s.rss_single[name] for s in window) / 2**20, 1),
            }
            # Per process, busiest first: shows how evenly the server's workers share the load.
            before, after = start.per_process[name], end.per_process[name]
            shares = sorted(
                ((after[pid] - before.get(pid, 0.0)) / elapsed * 100 for pid in after), reverse=True
            )
            out[name]["process_cpu_pct"] = [round(share, 1) for share in shares[:4] if share >= 0.5]
        if "machine" in out:
            # What else ran meanwhile (other benchmarks, tests): the machine minus what we watch.
            ours = sum(out[name]["cpu_pct"] for name in ("server", "postgres", "client") if name in out)
            out["other_cpu_pct"] = round(max(out["machine"]["cpu_pct"] - ours, 0.0), 1)
        return out


class LoopLag:
    """How late this process's event loop wakes from a short sleep: a busy or blocked load generator (or a
    starved CPU) shows here, so client-side delay is not mistaken for server latency."""

    def __init__(self, period_s: float = 0.02) -> None:
        self._period_s = period_s
        self.wall: array[float] = array("d")
        self.lag: array[float] = array("d")
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self._period_s)
            self.lag.append(loop.time() - before - self._period_s)
            self.wall.append(time.time())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def window(self, begin: float, end: float) -> dict[str, Any]:
        lags = sorted(lag for wall, lag in zip(self.wall, self.lag, strict=True) if begin <= wall <= end)
        return {
            "p50_ms": _ms(percentile(lags, 50)),
            "p99_ms": _ms(percentile(lags, 99)),
            "max_ms": _ms(lags[-1] if lags else None),
        }


# --- the server ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """`python -m lockledger serve --port P --workers N` against ``database_url``, reaper on."""

    def __init__(
        self,
        database_url: str,
        *,
        workers: int,
        env: dict[str, str],
        log_path: Path,
        port: int = 0,
        log_level: str = "warning",
    ) -> None:
        self.database_url = database_url
        self.workers = workers
        self.port = port or free_port()
        self.env = env
        self.log_path = log_path
        self.log_level = log_level
        self.process: asyncio.subprocess.Process | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            *("-m", "lockledger", "serve", "--port", str(self.port), "--workers", str(self.workers)),
            *("--log-level", self.log_level),
        ]

    async def start(self, timeout_s: float = 60.0) -> None:
        env = {**os.environ, "LOCKLEDGER_DATABASE_URL": self.database_url, **self.env}
        with self.log_path.open("ab") as log:
            process = await asyncio.create_subprocess_exec(
                *self.command, env=env, stdout=log, stderr=asyncio.subprocess.STDOUT
            )
        self.process = process
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                if process.returncode is not None:
                    raise RuntimeError(
                        f"lockledger serve exited with {process.returncode}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{self.base_url}/readyz") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.1)
        await self.stop()
        raise RuntimeError(f"lockledger serve not ready after {timeout_s} s:\n{self.log_tail()}")

    async def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (uvicorn stops its workers and the reapers), SIGKILL to the tree after ``timeout_s``."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            for child in _children(process.pid):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            process.kill()
            await process.wait()

    def check_alive(self) -> None:
        """Raise if the server exited during a scenario (its figures would be meaningless)."""
        if self.process is not None and self.process.returncode is not None:
            raise RuntimeError(
                f"lockledger serve exited during the run (status {self.process.returncode}; another "
                f"process may have signalled it):\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


# --- HTTP ------------------------------------------------------------------------------------------------

JSON_HEADERS = {"Content-Type": "application/json"}


class Http:
    """A lean aiohttp client: POST JSON with an Idempotency-Key and the calling agent's ``Authorization``
    (``bearer(token)``), return (status, body, seconds).

    Status 0 means the request failed below HTTP (connection error, timeout).
    """

    def __init__(self, base_url: str, *, connections: int, timeout_s: float = 30.0) -> None:
        self.base_url = base_url
        self._connections = connections
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Http:
        connector = aiohttp.TCPConnector(limit=self._connections, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(
        self, path: str, body: dict[str, Any], authorization: str, key: str | None = None
    ) -> tuple[int, bytes, float]:
        assert self._session is not None
        headers = {
            **JSON_HEADERS,
            "Authorization": authorization,
            "Idempotency-Key": key or os.urandom(12).hex(),
        }
        started = time.perf_counter()
        try:
            async with self._session.post(
                self.base_url + path, data=json.dumps(body).encode(), headers=headers
            ) as response:
                data = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0, b"", time.perf_counter() - started
        return status, data, time.perf_counter() - started


RETRYABLE = frozenset({0, 502, 503, 504})


async def post_with_retries(
    http: Http, path: str, body: dict[str, Any], authorization: str, *, attempts: int = 3
) -> tuple[int, bytes, float]:
    """Retry transport errors and 503 with the same Idempotency-Key, as a well-behaved agent does."""
    key = os.urandom(12).hex()
    status, data, seconds = 0, b"", 0.0
    for attempt in range(attempts):
        status, data, seconds = await http.post(path, body, authorization, key)
        if status not in RETRYABLE:
            break
        await asyncio.sleep(0.05 * (attempt + 1))
    return status, data, seconds


async def bounded(concurrency: int, jobs: Iterable[Callable[[], Awaitable[None]]]) -> None:
    """Run the jobs with at most ``concurrency`` in flight (a fixed set of workers, no task per job)."""
    iterator = iter(jobs)

    async def worker() -> None:
        for job in iterator:
            await job()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


# --- the database ----------------------------------------------------------------------------------------


async def connect_owner(database_url: str) -> asyncpg.Connection:
    """A connection as the URL's (schema-owning) user, UTC session clock."""
    return await asyncpg.connect(asyncpg_dsn(database_url), server_settings={"timezone": "UTC"})


async def events_by_type(conn: asyncpg.Connection, prefix: str) -> dict[str, int]:
    rows = await conn.fetch(
        "SELECT event_type, count(*) AS n FROM events WHERE stream_id LIKE $1 GROUP BY event_type",
        _like_prefix(prefix),
    )
    return {str(row["event_type"]): int(row["n"]) for row in rows}


def _like_prefix(prefix: str) -> str:
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


async def db_clock_offset_s(conn: asyncpg.Connection) -> float:
    """Database clock minus this machine's wall clock (about 0 on one host)."""
    before = time.time()
    db_now = float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8"))
    after = time.time()
    return db_now - (before + after) / 2


async def environment(database_url: str, options: FleetOptions) -> dict[str, Any]:
    """The machine and software record the throughput bench writes too, and this run's own settings."""
    conn = await connect_owner(database_url)
    try:
        settings = await server_settings(conn)
    finally:
        await conn.close()
    return {
        "kind": "environment",
        "run_id": options.run_id,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, "-m", "bench.fleet", *sys.argv[1:]]),
        **machine_environment(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "postgresql": settings.pop("postgresql"),
        "postgresql_settings": settings,
        "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "server_workers": options.server_workers,
        "auth": AUTH,
        "reaper_interval_ms": options.reaper_interval_ms,
        "reaper_batch_size": options.reaper_batch_size,
    }


def postgres_monitor_pid(backend_pid: int) -> int | None:
    """The postmaster of a local server (the parent of our backend), or None if it is not visible."""
    try:
        backend = psutil.Process(backend_pid)
        parent = backend.parent()
        if parent is not None and "postgres" in (parent.name() + " ".join(parent.cmdline())):
            return parent.pid
    except psutil.Error:
        pass
    return None


# --- API tokens ------------------------------------------------------------------------------------------


async def mint_authorizations(database_url: str, names: list[str]) -> tuple[list[str], dict[str, Any]]:
    """One agent token per name, minted in one statement, as ``Authorization`` header values (in the
    order of ``names``); and what minting them took."""
    started = time.perf_counter()
    tokens = await mint_agent_tokens(database_url, names)
    seconds = time.perf_counter() - started
    return [bearer(token) for token in tokens], {"minted": len(names), "seconds": round(seconds, 3)}


# --- scenario: heartbeats ---------------------------------------------------------------------------------


@dataclass
class RunContext:
    base_url: str
    database_url: str
    run_id: str
    sampler: Sampler
    console: Console
    loop_lag: LoopLag


async def run_heartbeats(ctx: RunContext, params: HeartbeatParams) -> dict[str, Any]:
    """A agents acquire, renew every ``interval_s`` for ``duration_s``, release; count lost leases."""
    prefix = f"fleet:hb:{ctx.run_id}:"
    n = params.agents
    tokens: list[int | None] = [None] * n
    deadlines: array[float] = array("d", bytes(8 * n))  # each lease's deadline, this machine's wall clock
    acquire_latency: array[float] = array("d")
    acquire_status: Counter[int] = Counter()
    loop = asyncio.get_running_loop()
    conn = await connect_owner(ctx.database_url)
    try:
        offset_s = await db_clock_offset_s(conn)
    finally:
        await conn.close()

    def deadline_of(body: bytes) -> float:
        return datetime.fromisoformat(json.loads(body)["expires_at"]).timestamp() - offset_s

    auth, minting = await mint_authorizations(ctx.database_url, agent_names(f"fleet-{ctx.run_id}-hb-", n))
    async with Http(ctx.base_url, connections=params.concurrency) as http:
        ctx.console.print(
            f"[bold]heartbeats[/bold]: {n} agents (API tokens minted in {minting['seconds']:.2f} s) "
            f"acquire (ttl {params.ttl_ms} ms)"
        )
        acquire_begin = ctx.sampler.snapshot()
        started = loop.time()

        def acquire_job(i: int) -> Callable[[], Awaitable[None]]:
            async def job() -> None:
                status, body, seconds = await post_with_retries(
                    http, f"/v1/locks/{prefix}{i}/acquire", {"ttl_ms": params.ttl_ms}, auth[i]
                )
                acquire_status[status] += 1
                acquire_latency.append(seconds)
                if status == 201:
                    tokens[i] = int(json.loads(body)["fencing_token"])
                    deadlines[i] = deadline_of(body)

            return job

        await bounded(params.concurrency, (acquire_job(i) for i in range(n)))
        acquire_s = loop.time() - started
        acquire_end = ctx.sampler.snapshot()
        held = sum(token is not None for token in tokens)
        if acquire_s + params.interval_s > params.ttl_ms / 1000 * 0.9:
            ctx.console.print(
                f"[yellow]acquiring took {acquire_s:.1f} s: the first renews may come after a lease's "
                "deadline (that would be the load generator's fault, not the service's)[/yellow]"
            )

        # Renew: agent i's first renew at start + interval * (i + U(0,1)) / n, then every interval.
        target_rate = n / params.interval_s
        ctx.console.print(
            f"  {held} held in {acquire_s:.1f} s; renewing every {params.interval_s:g} s for "
            f"{params.duration_s:g} s (~{target_rate:,.0f} renews/s)"
        )
        renew_latency: array[float] = array("d")
        renew_ok_latency: array[float] = array("d")
        send_lag: array[float] = array("d")
        renew_status: Counter[int] = Counter()
        late_sends = 0  # renews the load generator sent after the lease's deadline (it fell behind)
        # 409/410 answers: agent, status, how long before the deadline the renew was sent, latency, body
        lost: list[dict[str, Any]] = []
        start = loop.time() + 0.5
        end = start + params.duration_s

        async def agent(i: int) -> None:
            nonlocal late_sends
            token = tokens[i]
            if token is None:
                return
            first = start + params.interval_s * (i + random.random()) / n
            k = 0
            while (when := first + k * params.interval_s) < end:
                k += 1
                delay = when - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                send_lag.append(loop.time() - when)
                sent = time.time()
                late_sends += sent >= deadlines[i]
                status, body, seconds = await http.post(
                    f"/v1/locks/{prefix}{i}/renew", {"fencing_token": token}, auth[i]
                )
                renew_status[status] += 1
                renew_latency.append(seconds)
                if status == 200:
                    renew_ok_latency.append(seconds)
                    deadlines[i] = deadline_of(body)
                elif status in (409, 410):
                    lost.append(
                        {
                            "agent": i,
                            "status": status,
                            "sent_before_deadline_s": round(deadlines[i] - sent, 3),
                            "latency_s": round(seconds, 3),
                            "body": body.decode(errors="replace")[:300],
                        }
                    )
                    tokens[i] = None
                    return

        renew_begin = ctx.sampler.snapshot()
        agents = [asyncio.ensure_future(agent(i)) for i in range(n)]
        with quiet_gc():
            await asyncio.gather(*agents)
        renew_s = loop.time() - start
        renew_end = ctx.sampler.snapshot()

        ctx.console.print("  releasing")
        release_status: Counter[int] = Counter()
        release_latency: array[float] = array("d")

        def release_job(i: int) -> Callable[[], Awaitable[None]]:
            async def job() -> None:
                token = tokens[i]
                if token is None:
                    return
                status, _, seconds = await post_with_retries(
                    http, f"/v1/locks/{prefix}{i}/release", {"fencing_token": token}, auth[i]
                )
                release_status[status] += 1
                release_latency.append(seconds)

            return job

        started = loop.time()
        await bounded(params.concurrency, (release_job(i) for i in range(n)))
        release_s = loop.time() - started

    conn = await connect_owner(ctx.database_url)
    try:
        events = await events_by_type(conn, prefix)
        premature = int(
            await conn.fetchval(
                "SELECT count(*) FROM events WHERE stream_id LIKE $1 AND event_type = 'LOCK_EXPIRED' "
                "AND recorded_at < (data->>'expires_at')::timestamptz",
                _like_prefix(prefix),
            )
        )
    finally:
        await conn.close()

    renews_ok = renew_status.get(200, 0)
    spurious = events.get("LOCK_EXPIRED", 0)
    renew_errors = sum(c for s, c in renew_status.items() if s not in (200, 409, 410))
    lag = sorted(send_lag)
    checks = {
        "all_acquired": held == n,
        "every_renew_200": renews_ok == sum(renew_status.values()) and renews_ok > 0,
        "no_lost_lease": not lost,
        "no_spurious_expiry": spurious == 0,
        "no_expiry_before_deadline": premature == 0,
        "log_matches_answers": events.get("LOCK_RENEWED", 0) == renews_ok,
    }
    return {
        "kind": "heartbeats",
        "run_id": ctx.run_id,
        "params": asdict(params),
        "prefix": prefix,
        "tokens": minting,
        "acquire": {
            "held": held,
            "seconds": round(acquire_s, 2),
            "per_s": round(n / acquire_s, 1),
            "statuses": _statuses(acquire_status),
            "latency": latency_summary(acquire_latency),
            "resources": ctx.sampler.stats(acquire_begin, acquire_end),
        },
        "renew": {
            "target_per_s": round(target_rate, 1),
            "achieved_per_s": round(renews_ok / params.duration_s, 1),
            "ok": renews_ok,
            "statuses": _statuses(renew_status),
            "errors": renew_errors,
            "lost_leases": len(lost),
            # A lost lease whose renew was sent before the deadline: the service answered too late.
            # One sent after it: the load generator (or the machine) fell behind.
            "lost_sent_before_deadline": sum(1 for x in lost if x["sent_before_deadline_s"] > 0),
            "renews_sent_after_deadline": late_sends,
            "lost_examples": lost[:5],
            "latency_ok": latency_summary(renew_ok_latency),
            "latency_all": latency_summary(renew_latency),
            "client_loop_lag": ctx.loop_lag.window(renew_begin.wall, renew_end.wall),
            "send_lag_p99_ms": _ms(percentile(lag, 99)),
            "send_lag_max_ms": _ms(lag[-1] if lag else None),
            "seconds": round(renew_s, 2),
            "resources": ctx.sampler.stats(renew_begin, renew_end),
        },
        "release": {
            "seconds": round(release_s, 2),
            "statuses": _statuses(release_status),
            "latency": latency_summary(release_latency),
        },
        "events": events,
        "spurious_expiries": spurious,
        "expiries_before_deadline": premature,
        "checks": checks,
        "passed": all(checks.values()),
    }


# --- scenario: lapse -------------------------------------------------------------------------------------


class Probe:
    """Agents doing acquire/release cycles on their own resources; every command's start and latency.

    ``authorizations[j]`` is probe agent j's ``Authorization`` header value.
    """

    def __init__(self, http: Http, prefix: str, authorizations: Sequence[str], rate: float) -> None:
        self._http = http
        self._prefix = prefix
        self._auth = authorizations
        self._agents = agents = len(authorizations)
        self._interval = agents / rate if rate > 0 else 0.0  # per agent, between cycle starts
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.wall: array[float] = array("d")  # start of each command (this machine's wall clock)
        self.latency: array[float] = array("d")
        self.ok: array[int] = array("b")
        self.command: array[int] = array("b")  # 0 acquire, 1 release
        self.statuses: Counter[int] = Counter()

    def _record(self, wall: float, seconds: float, ok: bool, command: int, status: int) -> None:
        self.wall.append(wall)
        self.latency.append(seconds)
        self.ok.append(1 if ok else 0)
        self.command.append(command)
        self.statuses[status] += 1

    async def _agent(self, j: int) -> None:
        loop = asyncio.get_running_loop()
        next_start = loop.time() + (self._interval * random.random())
        k = 0
        while not self._stop.is_set():
            if self._interval:
                delay = next_start - loop.time()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay)
                    if self._stop.is_set():
                        return
                next_start = max(next_start + self._interval, loop.time())
            resource = f"{self._prefix}{j}:{k % 64}"
            k += 1
            wall = time.time()
            status, body, seconds = await self._http.post(
                f"/v1/locks/{resource}/acquire", {"ttl_ms": 30_000}, self._auth[j]
            )
            self._record(wall, seconds, status == 201, 0, status)
            if status != 201:
                await asyncio.sleep(0.05)
                continue
            token = int(json.loads(body)["fencing_token"])
            wall = time.time()
            status, _, seconds = await self._http.post(
                f"/v1/locks/{resource}/release", {"fencing_token": token}, self._auth[j]
            )
            self._record(wall, seconds, status == 200, 1, status)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._agent(j)) for j in range(self._agents)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def window(self, begin: float, end: float) -> dict[str, Any]:
        """Throughput, errors and latency of the commands started in [begin, end] (wall clock)."""
        picked = [i for i, wall in enumerate(self.wall) if begin <= wall <= end]
        seconds = max(end - begin, 1e-9)
        cycles = sum(1 for i in picked if self.command[i] == 1 and self.ok[i])
        return {
            "seconds": round(seconds, 2),
            "commands": len(picked),
            "cycles_per_s": round(cycles / seconds, 1),
            "errors": sum(1 for i in picked if not self.ok[i]),
            "latency": latency_summary(self.latency[i] for i in picked),
            "acquire_latency": latency_summary(self.latency[i] for i in picked if self.command[i] == 0),
        }


async def run_lapse(ctx: RunContext, params: LapseParams) -> dict[str, Any]:
    """L leases acquired and left to lapse while a probe keeps serving; lateness from the log."""
    prefix = f"fleet:lapse:{ctx.run_id}:"
    loop = asyncio.get_running_loop()
    # One token per creation slot (an agent taking many leases) and one per probe agent.
    slots = params.concurrency
    auth, minting = await mint_authorizations(
        ctx.database_url,
        agent_names(f"fleet-{ctx.run_id}-lapse-", slots)
        + agent_names(f"fleet-{ctx.run_id}-probe-", params.probe_agents),
    )
    creators, probers = auth[:slots], auth[slots:]
    conn = await connect_owner(ctx.database_url)
    try:
        offset_s = await db_clock_offset_s(conn)
        async with (
            Http(ctx.base_url, connections=params.concurrency) as http,
            Http(ctx.base_url, connections=max(params.probe_agents, 1)) as probe_http,
        ):
            probe = Probe(probe_http, f"fleet:probe:{ctx.run_id}:", probers, params.probe_rate)
            probe.start()
            try:
                baseline_begin = time.time()
                await asyncio.sleep(params.probe_baseline_s)
                baseline_end = time.time()

                # Calibration: the creation rate at this concurrency, with the probe running.
                ttl_ms, cluster_at = params.ttl_ms, None
                calibration: dict[str, Any] = {}
                if ttl_ms is None:
                    n_cal = min(params.calibration, max(params.leases // 10, 50))
                    cal_status: Counter[int] = Counter()

                    def cal_job(i: int) -> Callable[[], Awaitable[None]]:
                        async def job() -> None:
                            status, _, _ = await post_with_retries(
                                http,
                                f"/v1/locks/fleet:calib:{ctx.run_id}:{i}/acquire",
                                {"ttl_ms": TTL_MIN_MS},
                                creators[i % slots],
                            )
                            cal_status[status] += 1

                        return job

                    started = loop.time()
                    await bounded(params.concurrency, (cal_job(i) for i in range(n_cal)))
                    rate = n_cal / (loop.time() - started)
                    estimate_s = params.leases / rate
                    planned_s = estimate_s * 1.5 + params.margin_s
                    calibration = {
                        "acquires": n_cal,
                        "per_s": round(rate, 1),
                        "statuses": _statuses(cal_status),
                        "estimated_creation_s": round(estimate_s, 1),
                    }
                    if params.deadlines == "cluster":
                        cluster_at = loop.time() + planned_s
                    else:
                        ttl_ms = _clamp_ttl(planned_s * 1000)
                elif params.deadlines == "cluster":
                    cluster_at = loop.time() + ttl_ms / 1000
                ctx.console.print(
                    f"[bold]lapse[/bold]: {params.leases} leases, deadlines {params.deadlines}, "
                    + (
                        f"ttl {ttl_ms} ms"
                        if cluster_at is None
                        else f"all due in {cluster_at - loop.time():.0f} s"
                    )
                    + f"; probe {params.probe_agents} agents"
                    + (f" at {params.probe_rate:g} cycles/s" if params.probe_rate else " (closed loop)")
                )

                # Creation.
                deadlines: list[datetime] = []
                create_status: Counter[int] = Counter()
                create_latency: array[float] = array("d")

                def create_job(i: int) -> Callable[[], Awaitable[None]]:
                    async def job() -> None:
                        ttl = ttl_ms if cluster_at is None else _clamp_ttl((cluster_at - loop.time()) * 1000)
                        status, body, seconds = await post_with_retries(
                            http, f"/v1/locks/{prefix}{i}/acquire", {"ttl_ms": ttl}, creators[i % slots]
                        )
                        create_status[status] += 1
                        create_latency.append(seconds)
                        if status == 201:
                            deadlines.append(datetime.fromisoformat(json.loads(body)["expires_at"]))

                    return job

                create_begin_wall = time.time()
                create_begin = ctx.sampler.snapshot()
                await bounded(params.concurrency, (create_job(i) for i in range(params.leases)))
                create_end = ctx.sampler.snapshot()
                create_end_wall = time.time()
                created = len(deadlines)
                create_s = create_end_wall - create_begin_wall
                if not deadlines:
                    raise RuntimeError(f"no lease was created: {_statuses(create_status)}")
                first_deadline = min(deadlines).timestamp() - offset_s  # this machine's wall clock
                last_deadline = max(deadlines).timestamp() - offset_s
                early = sum(1 for d in deadlines if d.timestamp() - offset_s < create_end_wall)
                ctx.console.print(
                    f"  created {created} in {create_s:.1f} s ({created / create_s:,.0f}/s); deadlines "
                    f"{first_deadline - create_end_wall:+.1f} s .. {last_deadline - create_end_wall:+.1f} s "
                    "from now; waiting for the reaper"
                )

                # Wait for the first deadline, then poll until none is held.
                await asyncio.sleep(max(first_deadline - time.time(), 0))
                lapse_begin = ctx.sampler.snapshot()
                give_up = last_deadline + params.expiry_timeout_s
                backlog: list[tuple[float, int]] = []
                held = created
                while True:
                    held = int(
                        await conn.fetchval(
                            "SELECT count(*) FROM lock_state WHERE resource LIKE $1 AND status = 'held'",
                            _like_prefix(prefix),
                        )
                    )
                    now = time.time()
                    backlog.append((round(now - first_deadline, 2), held))
                    if held == 0 or now > give_up:
                        break
                    await asyncio.sleep(params.poll_interval_s)
                all_expired_wall = time.time()
                lapse_end = ctx.sampler.snapshot()
                await asyncio.sleep(0.5)
            finally:
                await probe.stop()

        lateness = await _lateness(conn, prefix)
        events = await events_by_type(conn, prefix)
    finally:
        await conn.close()

    last_expiry = lateness["last_expiry_epoch"]
    lapse_window_end = (last_expiry - offset_s) if last_expiry is not None else all_expired_wall
    probe_lapse = probe.window(first_deadline, lapse_window_end)
    over_limit = lateness["over_10s"]
    checks = {
        "all_created": created == params.leases,
        "lapsed_after_creation": early == 0,
        "all_expired": held == 0 and lateness["expired"] == created,
        "none_later_than_10s": over_limit == 0,
        "lateness_p99_under_1s": (lateness["p99_s"] or 0.0) < LATENESS_P99_LIMIT_S,
        "probe_no_errors": probe_lapse["errors"] == 0,
    }
    return {
        "kind": "lapse",
        "run_id": ctx.run_id,
        "params": asdict(params),
        "prefix": prefix,
        "tokens": minting,
        "calibration": calibration,
        "ttl_ms": ttl_ms,
        "create": {
            "created": created,
            "seconds": round(create_s, 2),
            "per_s": round(created / create_s, 1),
            "statuses": _statuses(create_status),
            "latency": latency_summary(create_latency),
            "resources": ctx.sampler.stats(create_begin, create_end),
            "lapsed_before_creation_finished": early,
        },
        "deadlines": {
            "first_after_creation_s": round(first_deadline - create_end_wall, 2),
            "spread_s": round(last_deadline - first_deadline, 2),
        },
        "expiry": {
            **lateness,
            "still_held": held,
            "last_deadline_to_last_expiry_s": lateness["last_deadline_to_last_expiry_s"],
            "resources": ctx.sampler.stats(lapse_begin, lapse_end),
            "client_loop_lag": ctx.loop_lag.window(lapse_begin.wall, lapse_end.wall),
            "backlog": _thin(backlog, 120),
        },
        "events": events,
        "probe": {
            "agents": params.probe_agents,
            "rate": params.probe_rate or "closed loop",
            "baseline": probe.window(baseline_begin, baseline_end),
            "during_creation": probe.window(create_begin_wall, create_end_wall),
            "during_lapse": probe_lapse,
            "statuses": _statuses(probe.statuses),
        },
        "checks": checks,
        "passed": all(checks.values()),
    }


def _clamp_ttl(ms: float) -> int:
    return int(min(max(math.ceil(ms), TTL_MIN_MS), TTL_MAX_MS))


def _thin(points: list[tuple[float, int]], keep: int) -> list[tuple[float, int]]:
    if len(points) <= keep:
        return points
    step = len(points) / keep
    return [points[int(i * step)] for i in range(keep)] + [points[-1]]


LATENESS_SQL = """
WITH e AS (
    SELECT recorded_at, (data->>'expires_at')::timestamptz AS deadline, metadata->>'actor' AS actor
      FROM events
     WHERE stream_id LIKE $1 AND event_type = 'LOCK_EXPIRED'
), l AS (
    SELECT *, extract(epoch FROM recorded_at - deadline)::float8 AS late FROM e
)
SELECT count(*) AS expired,
       count(*) FILTER (WHERE actor = 'reaper') AS by_reaper,
       percentile_disc(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY late) AS pct,
       max(late) AS max_late,
       min(late) AS min_late,
       count(*) FILTER (WHERE late > 1) AS over_1s,
       count(*) FILTER (WHERE late > $2) AS over_10s,
       extract(epoch FROM max(recorded_at) - max(deadline))::float8 AS last_deadline_to_last_expiry,
       extract(epoch FROM max(recorded_at) - min(recorded_at))::float8 AS expiry_span,
       extract(epoch FROM max(recorded_at))::float8 AS last_expiry_epoch
  FROM l
"""

PEAK_RATE_SQL = """
SELECT coalesce(max(n), 0) FROM (
    SELECT count(*) AS n FROM events
     WHERE stream_id LIKE $1 AND event_type = 'LOCK_EXPIRED'
     GROUP BY date_trunc('second', recorded_at)
) per_second
"""


async def _lateness(conn: asyncpg.Connection, prefix: str) -> dict[str, Any]:
    row = await conn.fetchrow(LATENESS_SQL, _like_prefix(prefix), LATENESS_LIMIT_S)
    assert row is not None
    peak = int(await conn.fetchval(PEAK_RATE_SQL, _like_prefix(prefix)))
    pct = row["pct"] or [None, None, None]
    expired = int(row["expired"])
    span = row["expiry_span"]

    def r(value: float | None) -> float | None:
        return None if value is None else round(float(value), 4)

    return {
        "expired": expired,
        "by_reaper": int(row["by_reaper"]),
        "p50_s": r(pct[0]),
        "p95_s": r(pct[1]),
        "p99_s": r(pct[2]),
        "max_s": r(row["max_late"]),
        "min_s": r(row["min_late"]),
        "over_1s": int(row["over_1s"]),
        "over_10s": int(row["over_10s"]),
        "last_deadline_to_last_expiry_s": r(row["last_deadline_to_last_expiry"]),
        "mean_rate_per_s": round(expired / span, 1) if span else None,
        "peak_rate_per_s": peak,
        "last_expiry_epoch": row["last_expiry_epoch"],
    }


# --- the run ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def database(database_url: str | None, console: Console) -> Iterator[tuple[str, int | None]]:
    """(URL, embedded postmaster pid or None): the given server, or the throughput bench's own kind of
    embedded cluster (``bench.database.provision``: migrated, its WAL segments made)."""
    from lockledger.migrate import upgrade

    if database_url:
        upgrade(database_url)
        yield database_url, None
        return
    console.print("starting the embedded PostgreSQL")
    bench_db = provision(None)
    try:
        wal = bench_db.info["wal_segments_prepared"]
        console.print(f"prepared {wal['segments']} WAL segments in {wal['seconds']} s")
        yield bench_db.url, bench_db.postgres_pid
    finally:
        bench_db.close()


@contextlib.asynccontextmanager
async def running_server(
    database_url: str, options: FleetOptions, console: Console
) -> AsyncIterator[ServerProcess]:
    log_dir = Path(tempfile.mkdtemp(prefix="lockledger-fleet-server-"))
    env = {
        "LOCKLEDGER_REAPER_ENABLED": "true",
        "LOCKLEDGER_REAPER_INTERVAL_MS": str(options.reaper_interval_ms),
        "LOCKLEDGER_REAPER_BATCH_SIZE": str(options.reaper_batch_size),
        **options.server_env,
        "LOCKLEDGER_DEV_MODE": "false",  # authentication on, as in production: the agents send tokens
    }
    server = ServerProcess(
        database_url, workers=options.server_workers, env=env, log_path=log_dir / "serve.log"
    )
    await server.start()
    console.print(f"server {server.base_url} ({options.server_workers} workers), log {server.log_path}")
    try:
        yield server
    finally:
        await server.stop()


async def run_fleet(
    database_url: str, options: FleetOptions, console: Console | None = None
) -> list[dict[str, Any]]:
    """Start the server on ``database_url`` (already migrated), run the scenarios, return JSON records."""
    console = console or Console(stderr=True)
    records: list[dict[str, Any]] = [await environment(database_url, options)]
    conn = await connect_owner(database_url)
    try:
        postmaster = postgres_monitor_pid(int(await conn.fetchval("SELECT pg_backend_pid()")))
    finally:
        await conn.close()
    async with running_server(database_url, options, console) as server:
        assert server.process is not None
        monitors: dict[str, ProcessTreeMonitor | MachineMonitor] = {
            "server": ProcessTreeMonitor(server.process.pid),
            "client": ProcessTreeMonitor(os.getpid(), recursive=False),
            "machine": MachineMonitor(),
        }
        if postmaster is not None:
            monitors["postgres"] = ProcessTreeMonitor(postmaster)
        sampler = Sampler(monitors)
        sampler.start()
        try:
            loop_lag = LoopLag()
            loop_lag.start()
            ctx = RunContext(server.base_url, database_url, options.run_id, sampler, console, loop_lag)
            begin = sampler.snapshot()
            if "heartbeats" in options.scenarios:
                records.append(await run_heartbeats(ctx, options.heartbeats))
                server.check_alive()
            if "lapse" in options.scenarios:
                records.append(await run_lapse(ctx, options.lapse))
                server.check_alive()
            records[0]["whole_run_resources"] = sampler.stats(begin, sampler.snapshot())
        finally:
            await loop_lag.stop()
            await sampler.stop()
    return records


def write_jsonl(records: list[dict[str, Any]], output_dir: Path) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = output_dir / f"fleet-{stamp}.jsonl"
    with path.open("w") as out:
        for record in records:
            out.write(json.dumps(record, default=str) + "\n")
    return path


# --- the report ------------------------------------------------------------------------------------------


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    elif isinstance(value, int):
        text = f"{value:,}"
    else:
        text = str(value)
    return text + unit


def _verdict(ok: bool) -> str:
    return "[green]ok[/green]" if ok else "[red]MISSED[/red]"


def _resources_rows(table: Table, label: str, resources: dict[str, Any]) -> None:
    server = resources.get("server", {})
    table.add_row(
        f"{label}: server CPU (per process) / peak RSS (tree, largest process)",
        f"{_fmt(server.get('cpu_pct'), ' %')} ({', '.join(map(str, server.get('process_cpu_pct', [])))}) / "
        f"{_fmt(server.get('peak_rss_mb'), ' MB')}, {_fmt(server.get('peak_process_rss_mb'), ' MB')}",
        "",
        "",
    )
    others = [
        f"{name} {_fmt(resources[name].get('cpu_pct'), ' %')}"
        for name in ("postgres", "client")
        if name in resources
    ]
    if "other_cpu_pct" in resources:
        others.append(f"rest of machine {_fmt(resources['other_cpu_pct'], ' %')}")
    table.add_row(f"{label}: CPU elsewhere (100 % = 1 core)", ", ".join(others), "", "")
    if resources.get("other_cpu_pct", 0) > OTHER_LOAD_WARNING_PCT:
        table.add_row(
            f"[yellow]{label}: other processes used {resources['other_cpu_pct']} % of a core[/yellow]",
            "[yellow]figures disturbed; rerun on a quiet machine[/yellow]",
            "",
            "",
        )


def heartbeats_table(record: dict[str, Any]) -> Table:
    p = record["params"]
    renew, acquire = record["renew"], record["acquire"]
    latency = renew["latency_ok"]
    table = Table(
        title=f"heartbeats: {p['agents']:,} agents, renew every {p['interval_s']:g} s "
        f"for {p['duration_s']:g} s, ttl {p['ttl_ms']:,} ms"
    )
    for column in ("measure", "value", "target", ""):
        table.add_column(column)
    checks = record["checks"]
    table.add_row(
        "API tokens minted (one per agent; authentication on)",
        f"{record['tokens']['minted']:,} in {record['tokens']['seconds']} s",
        "",
        "",
    )
    table.add_row(
        "acquired",
        f"{acquire['held']:,} in {acquire['seconds']} s ({_fmt(acquire['per_s'])}/s)",
        "all",
        _verdict(checks["all_acquired"]),
    )
    table.add_row(
        "renews/s achieved",
        f"{_fmt(renew['achieved_per_s'])} ({renew['ok']:,} renews)",
        _fmt(renew["target_per_s"]),
        _verdict(renew["achieved_per_s"] >= 0.95 * renew["target_per_s"]),
    )
    table.add_row(
        "renew latency p50 / p95 / p99 / max",
        f"{_fmt(latency['p50_ms'])} / {_fmt(latency['p95_ms'])} / {_fmt(latency['p99_ms'])} / "
        f"{_fmt(latency['max_ms'])} ms",
        "",
        "",
    )
    table.add_row(
        "renew statuses", json.dumps(renew["statuses"]), "all 200", _verdict(checks["every_renew_200"])
    )
    table.add_row("lost leases (409/410)", _fmt(renew["lost_leases"]), "0", _verdict(checks["no_lost_lease"]))
    table.add_row(
        "spurious expiries (LOCK_EXPIRED in the log)",
        _fmt(record["spurious_expiries"]),
        "0",
        _verdict(checks["no_spurious_expiry"]),
    )
    if renew["lost_leases"] or renew["renews_sent_after_deadline"]:
        table.add_row(
            "  lost with renew sent before the deadline / renews sent after it",
            f"{renew['lost_sent_before_deadline']:,} / {renew['renews_sent_after_deadline']:,}",
            "",
            "",
        )
    table.add_row(
        "expiries recorded before their deadline",
        _fmt(record["expiries_before_deadline"]),
        "0",
        _verdict(checks["no_expiry_before_deadline"]),
    )
    table.add_row(
        "client: renew send lag p99 / max; event-loop lag p99 / max",
        f"{_fmt(renew['send_lag_p99_ms'])} / {_fmt(renew['send_lag_max_ms'])} ms; "
        f"{_fmt(renew['client_loop_lag']['p99_ms'])} / {_fmt(renew['client_loop_lag']['max_ms'])} ms",
        "",
        "",
    )
    _resources_rows(table, "renew phase", renew["resources"])
    table.add_row("release statuses", json.dumps(record["release"]["statuses"]), "", "")
    return table


def lapse_table(record: dict[str, Any]) -> Table:
    p = record["params"]
    create, expiry, probe, checks = record["create"], record["expiry"], record["probe"], record["checks"]
    ttl = f"ttl {record['ttl_ms']:,} ms" if record["ttl_ms"] else "deadlines clustered"
    table = Table(
        title=f"lapse: {p['leases']:,} leases ({p['deadlines']}, {ttl}), probe {p['probe_agents']} agents"
    )
    for column in ("measure", "value", "target", ""):
        table.add_column(column)
    table.add_row(
        "API tokens minted (creation slots + probe; authentication on)",
        f"{record['tokens']['minted']:,} in {record['tokens']['seconds']} s",
        "",
        "",
    )
    table.add_row(
        "created",
        f"{create['created']:,} in {create['seconds']} s ({_fmt(create['per_s'])}/s)",
        "all",
        _verdict(checks["all_created"]),
    )
    table.add_row(
        "first deadline after creation / deadline spread",
        f"{record['deadlines']['first_after_creation_s']} s / {record['deadlines']['spread_s']} s",
        "> 0 s",
        _verdict(checks["lapsed_after_creation"]),
    )
    table.add_row(
        "expired (by the reaper) / still held",
        f"{expiry['expired']:,} ({expiry['by_reaper']:,}) / {expiry['still_held']:,}",
        "all / 0",
        _verdict(checks["all_expired"]),
    )
    table.add_row(
        "lateness p50 / p95 / p99 / max",
        f"{_fmt(expiry['p50_s'])} / {_fmt(expiry['p95_s'])} / {_fmt(expiry['p99_s'])} / "
        f"{_fmt(expiry['max_s'])} s",
        "p99 < 1 s",
        _verdict(checks["lateness_p99_under_1s"]),
    )
    table.add_row(
        "expired > 10 s / > 1 s after deadline",
        f"{expiry['over_10s']:,} / {expiry['over_1s']:,}",
        "0 / -",
        _verdict(checks["none_later_than_10s"]),
    )
    table.add_row(
        "last deadline -> last expiry", _fmt(expiry["last_deadline_to_last_expiry_s"], " s"), "", ""
    )
    table.add_row(
        "reaper rate mean / peak (expiries/s)",
        f"{_fmt(expiry['mean_rate_per_s'])} / {_fmt(expiry['peak_rate_per_s'])}",
        "",
        "",
    )
    for label, key in (
        ("probe, idle", "baseline"),
        ("probe, creation", "during_creation"),
        ("probe, lapse window", "during_lapse"),
    ):
        w = probe[key]
        lat = w["latency"]
        table.add_row(
            f"{label}: cycles/s, p50 / p99, errors",
            f"{_fmt(w['cycles_per_s'])}, {_fmt(lat['p50_ms'])} / {_fmt(lat['p99_ms'])} ms, {w['errors']}",
            "0 errors" if key == "during_lapse" else "",
            _verdict(checks["probe_no_errors"]) if key == "during_lapse" else "",
        )
    _resources_rows(table, "creation", create["resources"])
    _resources_rows(table, "lapse window", expiry["resources"])
    return table


def environment_line(record: dict[str, Any]) -> str:
    return (
        f"{record['cpu_count']} CPUs, {record['memory_gb']} GB, Python {record['python']}, "
        f"PostgreSQL {record['postgresql']} ({record['postgresql_settings']}), "
        f"{record['server_workers']} server workers, auth {record.get('auth')}, "
        f"reaper {record['reaper_interval_ms']} ms / {record['reaper_batch_size']}, "
        f"git {record['git_commit']}, "
        f"client loop {record['event_loop']}"
    )


def print_report(records: list[dict[str, Any]], console: Console) -> None:
    for record in records:
        if record["kind"] == "environment":
            console.print(environment_line(record))
        elif record["kind"] == "heartbeats":
            console.print(heartbeats_table(record))
        elif record["kind"] == "lapse":
            console.print(lapse_table(record))


# --- command line ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> tuple[FleetOptions, str | None]:
    """The options, and the database URL (None: start an embedded PostgreSQL)."""
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["heartbeats", "lapse", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="500 agents, 15 s, 5,000 leases")
    parser.add_argument("--agents", type=int, help="heartbeating agents (10,000)")
    parser.add_argument("--duration", type=float, help="seconds of heartbeats (60)")
    parser.add_argument("--heartbeat-interval", type=float, default=10.0, help="seconds between renews (10)")
    parser.add_argument(
        "--heartbeat-ttl-ms", type=int, default=30_000, help="lease TTL of the agents (30000)"
    )
    parser.add_argument("--leases", type=int, help="leases left to lapse (100,000)")
    parser.add_argument(
        "--lapse-ttl-ms", type=int, help="fixed TTL of the lapsing leases (default: calibrated)"
    )
    parser.add_argument(
        "--lapse-deadlines",
        choices=["spread", "cluster"],
        default="spread",
        help="spread: one TTL, deadlines at the creation rate; cluster: every deadline at one instant",
    )
    parser.add_argument("--probe-agents", type=int, default=16, help="serving probe agents during the lapse")
    parser.add_argument(
        "--probe-rate", type=float, default=0.0, help="probe cycles/s in total (0: closed loop)"
    )
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight while creating")
    parser.add_argument("--expiry-timeout", type=float, default=120.0, help="seconds after the last deadline")
    parser.add_argument("--server-workers", type=int, default=1)
    parser.add_argument("--reaper-interval-ms", type=int, default=200)
    parser.add_argument("--reaper-batch-size", type=int, default=1_000)
    parser.add_argument("--server-log-level", default="warning", help="uvicorn log level of the server")
    parser.add_argument("--database-url", help="a PostgreSQL to use (migrated first); default: embedded")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    quick = args.quick
    options = FleetOptions(
        scenarios=("heartbeats", "lapse") if args.scenario == "all" else (args.scenario,),
        heartbeats=HeartbeatParams(
            agents=args.agents or (500 if quick else 10_000),
            duration_s=args.duration or (15.0 if quick else 60.0),
            interval_s=args.heartbeat_interval,
            ttl_ms=args.heartbeat_ttl_ms,
            concurrency=args.concurrency,
        ),
        lapse=LapseParams(
            leases=args.leases or (5_000 if quick else 100_000),
            concurrency=args.concurrency,
            ttl_ms=args.lapse_ttl_ms,
            deadlines=args.lapse_deadlines,
            probe_agents=args.probe_agents,
            probe_rate=args.probe_rate,
            expiry_timeout_s=args.expiry_timeout,
        ),
        server_workers=args.server_workers,
        reaper_interval_ms=args.reaper_interval_ms,
        reaper_batch_size=args.reaper_batch_size,
        server_log_level=args.server_log_level,
        output_dir=args.output_dir,
    )
    return options, args.database_url


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    options, database_url = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    with database(database_url, console) as (url, _), asyncio.Runner(loop_factory=_loop_factory()) as runner:
        records = runner.run(run_fleet(url, options, console))
    print_report(records, console)
    if options.output_dir is not None:
        console.print(f"results: {write_jsonl(records, options.output_dir)}")
    return 0 if all(r.get("passed", True) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
