"""CPU and memory of the processes involved, sampled every 100 ms on a background thread.

Groups: the lockledger server (its process and every worker under it), PostgreSQL (the postmaster and its
backends), Redis, the load generator itself (this process, less the sampler thread's own CPU), and the
whole machine (busy CPU of all cores, memory in use), so that what other processes took during a cell is
known. CPU is accounted per process id: a process's CPU counts from the first sample that saw it (from
zero if it was born after the sampler started), so backends that come and go are counted and none twice.
Besides its own samples, ``snapshot()`` takes one at a given moment, to mark where a phase begins or ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import psutil

INTERVAL_S = 0.1
MACHINE = "machine"  # every process on the machine, ours or not (busy CPU of all cores)


def _machine_busy_s() -> float:
    times = psutil.cpu_times()
    return float(times.user + times.system + getattr(times, "nice", 0.0) + getattr(times, "irq", 0.0)
                 + getattr(times, "softirq", 0.0))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # time.perf_counter()
    cpu_s: dict[str, float]  # group -> CPU seconds since the sampler started
    rss: dict[str, int]  # group -> resident bytes, summed over the group's processes
    rss_max: dict[str, int] = field(default_factory=dict)  # group -> resident bytes of its largest process
    process_cpu_s: dict[str, dict[int, float]] = field(default_factory=dict)  # group -> pid -> CPU s


def process_tree(root_pid: int) -> list[psutil.Process]:
    """``root_pid`` and all its descendants that are still alive."""
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


@dataclass
class _Group:
    root_pid: int | None  # None: this process
    baselines: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)


class Sampler:
    def __init__(self, groups: dict[str, int | None], interval_s: float = INTERVAL_S) -> None:
        self._groups = {name: _Group(pid) for name, pid in groups.items()}
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one sample at a time: the thread's, or a ``snapshot()``
        self._thread: threading.Thread | None = None
        self._self = psutil.Process()
        self._started_at = 0.0  # wall clock, to tell processes born after the start
        self._own_thread_cpu = 0.0
        self._machine_start = 0.0
        self.samples: list[Sample] = []

    def start(self) -> None:
        self._started_at = time.time()
        self._machine_start = _machine_busy_s()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples

    def _run(self) -> None:
        start_thread_cpu = time.thread_time()
        while True:
            self._own_thread_cpu = time.thread_time() - start_thread_cpu
            self.snapshot()
            if self._stop.wait(self._interval_s):
                self._own_thread_cpu = time.thread_time() - start_thread_cpu
                self.snapshot()
                return

    def snapshot(self) -> Sample:
        """Take a sample now (from any thread), keep it with the others and return it."""
        with self._lock:
            sample = self._sample()
            self.samples.append(sample)
        return sample

    def _sample(self) -> Sample:
        at = time.perf_counter()
        cpu: dict[str, float] = {}
        rss: dict[str, int] = {}
        rss_max: dict[str, int] = {}
        per_process: dict[str, dict[int, float]] = {}
        for name, group in self._groups.items():
            processes = [self._self] if group.root_pid is None else process_tree(group.root_pid)
            total_rss = largest_rss = 0
            for process in processes:
                try:
                    with process.oneshot():
                        times = process.cpu_times()
                        used = times.user + times.system
                        process_rss = process.memory_info().rss
                        total_rss += process_rss
                        largest_rss = max(largest_rss, process_rss)
                        if process.pid not in group.baselines:
                            born_after = process.create_time() >= self._started_at
                            group.baselines[process.pid] = 0.0 if born_after and self.samples else used
                except psutil.Error:
                    continue
                group.last[process.pid] = used
            spent = sum(group.last[pid] - base for pid, base in group.baselines.items() if pid in group.last)
            if group.root_pid is None:
                spent -= self._own_thread_cpu
            cpu[name] = spent
            rss[name] = total_rss
            rss_max[name] = largest_rss
            per_process[name] = {
                pid: group.last[pid] - base for pid, base in group.baselines.items() if pid in group.last
            }
        cpu[MACHINE] = _machine_busy_s() - self._machine_start
        rss[MACHINE] = rss_max[MACHINE] = psutil.virtual_memory().used
        per_process[MACHINE] = {}
        return Sample(at, cpu, rss, rss_max, per_process)


@dataclass(frozen=True)
class Usage:
    cpu_pct: dict[str, float | None]  # percent of one core over the window
    peak_rss_mb: dict[str, float | None]  # over the whole cell
    window_s: float


def usage(samples: list[Sample], start: float, end: float) -> Usage:
    """CPU between the first sample at or after ``start`` and the last one at or before ``end``."""
    inside = [s for s in samples if start <= s.at <= end]
    names = list(samples[0].cpu_s) if samples else []
    if len(inside) < 2:
        inside = samples[:1] + samples[-1:] if len(samples) >= 2 else []
    if not inside:
        return Usage({n: None for n in names}, {n: None for n in names}, 0.0)
    first, last = inside[0], inside[-1]
    elapsed = last.at - first.at
    cpu: dict[str, float | None] = {
        name: round((last.cpu_s[name] - first.cpu_s[name]) / elapsed * 100, 1) if elapsed > 0 else None
        for name in names
    }
    peak: dict[str, float | None] = {
        name: round(max(s.rss[name] for s in samples) / 2**20, 1) for name in names
    }
    return Usage(cpu, peak, elapsed)


def others_pct(cpu: Mapping[str, float | None]) -> float | None:
    """CPU taken by processes that are none of the sampled groups (in % of one core): the machine's less
    every group's."""
    machine = cpu.get(MACHINE)
    if machine is None:
        return None
    ours = sum(v for k, v in cpu.items() if k != MACHINE and v is not None)
    return round(max(machine - ours, 0.0), 1)
