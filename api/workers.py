"""Several server processes, each accepting connections on a listening socket of its own.

uvicorn's ``--workers`` shares one listening socket between its processes, and whichever is awake first
takes everything that waits. When a fleet connects at once (after a restart, say), one worker took 63 of
64 connections here; agents keep their connections, so that worker served nearly every request while
the other idled. Here each worker binds the port itself with ``SO_REUSEPORT``, and the kernel spreads new
connections across the workers' sockets (by a hash of each connection's addresses).

``SO_REUSEPORT`` would also let a second server on the same port share it silently, and two servers on
two databases behind one port would hand out the same lock twice. So the supervisor first binds the port
*without* it: if anything listens there (another lockledger included), startup fails instead. Then it
only supervises: it starts a worker again when one dies, stops them all on SIGINT or SIGTERM.

A worker that keeps dying right after it starts is restarted after a pause that doubles up to
``BACKOFF_MAX_S``, while the other workers go on serving; the supervisor gives up (exit status 1) only
when every worker keeps failing so (a database that cannot be reached, say).

Workers never outlive their supervisor, however it ends (``kill -9`` included), so that they cannot go on
serving unsupervised and hold the port against the next start. Each worker watches the supervisor in two
ways: on Linux the kernel sends it SIGTERM when the supervisor dies (``PR_SET_PDEATHSIG``; the supervisor
starts workers from its main thread, whose end is what the kernel watches), and on every platform a
thread waits on multiprocessing's parent sentinel, a pipe whose other end only the supervisor holds,
which reaches end-of-file when its process ends. Either starts uvicorn's graceful shutdown; a worker
still running ``STOP_TIMEOUT_S`` later exits at once. A supervisor that died before the worker could
ask is noticed at start (its parent is no longer the supervisor, or the sentinel is already closed).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

from service.logs import configure_logging

log = logging.getLogger("uvicorn.error")

# A worker that dies sooner than this after it started counts as failing to start; one that has run
# this long counts as healthy again.
QUICK_DEATH_S = 10.0
# When every worker has failed to start this many times in a row, the server stops.
QUICK_DEATHS_TO_GIVE_UP = 3
# The pause before starting again a worker that failed to start: doubling from the first to the last.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.2

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def claim_port(host: str, port: int) -> int:
    """Check that nothing listens on ``host:port`` and return the port (a free one for port 0).

    The probe sets ``SO_REUSEADDR`` (as uvicorn does), so connections of a previous run still in
    TIME_WAIT do not block a restart, but not ``SO_REUSEPORT``, so any listener does.
    """
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        return int(probe.getsockname()[1])


def worker_socket(host: str, port: int) -> socket.socket:
    """This worker's own socket on the shared port (uvicorn starts listening on it)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def backoff_s(quick_deaths: int) -> float:
    """The pause before restarting a worker after ``quick_deaths`` quick deaths in a row (0: none)."""
    if quick_deaths <= 0:
        return 0.0
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** (quick_deaths - 1))


def _ask_kernel_for_sigterm_on_parent_death() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as error:  # the sentinel thread still watches
        log.warning("cannot ask the kernel to stop this worker with its supervisor: %s", error)


def _stop_when_gone(supervisor: BaseProcess) -> None:
    supervisor.join()  # returns once the supervisor's process has ended, however it ended
    log.warning("worker %s: the supervisor (pid %s) is gone; stopping", os.getpid(), supervisor.pid)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown, in the main thread
    time.sleep(STOP_TIMEOUT_S)
    os._exit(1)  # the graceful shutdown did not finish


def end_with_supervisor() -> None:
    """In a worker: make sure it stops when the supervisor that started it dies (module docstring)."""
    supervisor = multiprocessing.parent_process()
    if supervisor is None:  # not started by a supervisor
        return
    if sys.platform == "linux":
        _ask_kernel_for_sigterm_on_parent_death()
    if os.getppid() != supervisor.pid:  # it died before the kernel was asked
        raise SystemExit(1)
    threading.Thread(
        target=_stop_when_gone, args=(supervisor,), name="lockledger-supervisor-watch", daemon=True
    ).start()


def _serve_one(config: uvicorn.Config) -> None:
    """One worker process: its socket, then uvicorn's server until SIGINT or SIGTERM."""
    end_with_supervisor()
    config.configure_logging()  # a spawned process starts without the parent's logging set-up
    configure_logging(config.log_level or "info")
    uvicorn.Server(config).run(sockets=[worker_socket(config.host, config.port)])


@dataclass
class _Slot:
    """One of the ``workers`` places: its current process (None while waiting to restart it)."""

    index: int
    process: BaseProcess | None = None
    started: float = 0.0
    quick_deaths: int = 0  # in a row
    restart_at: float = 0.0


class Supervisor:
    """Runs ``workers`` processes of ``config`` (its app an import string) until told to stop."""

    def __init__(self, config: uvicorn.Config, workers: int) -> None:
        self.config = config
        self.workers = workers
        self._context = multiprocessing.get_context("spawn")
        self._slots = [_Slot(index) for index in range(workers)]
        self._stopping = False

    def run(self) -> int:
        """Serve until SIGINT or SIGTERM; the exit status (1 when every worker kept failing to start)."""
        self.config.port = claim_port(self.config.host, self.config.port)
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for slot in self._slots:
                self._start(slot)
            return self._supervise()
        finally:
            self._stop_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def _start(self, slot: _Slot) -> None:
        process = self._context.Process(target=_serve_one, args=(self.config,), name="lockledger-worker")
        process.start()
        slot.process, slot.started = process, time.monotonic()

    def _supervise(self) -> int:
        while not self._stopping:
            time.sleep(POLL_S)
            for slot in self._slots:
                if self._stopping:
                    break
                if not self._check(slot, time.monotonic()):
                    return 1
        return 0

    def _check(self, slot: _Slot, now: float) -> bool:
        """Note how the slot's worker is doing and start it again when due; False to give up."""
        process = slot.process
        if process is not None:
            if process.is_alive():
                if slot.quick_deaths and now - slot.started >= QUICK_DEATH_S:
                    log.warning("worker %s has been serving for %.0f s again", process.pid, QUICK_DEATH_S)
                    slot.quick_deaths = 0
                return True
            self._died(slot, process, now)
            if all(s.quick_deaths >= QUICK_DEATHS_TO_GIVE_UP for s in self._slots):
                log.error(
                    "every worker keeps exiting as it starts (last: %s with %s); stopping",
                    process.pid,
                    process.exitcode,
                )
                return False
        if slot.process is None and now >= slot.restart_at:
            self._start(slot)
        return True

    def _died(self, slot: _Slot, process: BaseProcess, now: float) -> None:
        lived_s = now - slot.started
        slot.quick_deaths = slot.quick_deaths + 1 if lived_s < QUICK_DEATH_S else 0
        pause_s = backoff_s(slot.quick_deaths)
        slot.process, slot.restart_at = None, now + pause_s
        if slot.quick_deaths:
            log.warning(
                "worker %s exited with %s %.1f s after it started (%d times in a row); starting another in"
                " %.1f s, the other workers serve meanwhile",
                process.pid,
                process.exitcode,
                lived_s,
                slot.quick_deaths,
                pause_s,
            )
        else:
            log.warning("worker %s exited with %s; starting another", process.pid, process.exitcode)
        process.close()  # its sentinel pipe, now rather than when collected

    def _stop_all(self) -> None:
        """SIGTERM every worker (uvicorn finishes what it serves), SIGKILL any still running after that."""
        processes = [slot.process for slot in self._slots if slot.process is not None]
        for process in processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
