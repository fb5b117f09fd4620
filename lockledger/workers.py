"""Several server processes, each accepting connections on a listening socket of its own.

uvicorn's ``--workers`` shares one listening socket between its processes, and whichever is awake first
takes everything that waits. When a fleet connects at once (after a restart, say), one worker took 63 of
64 connections here; agents keep their connections, so that worker served nearly every request while
the other idled. Here each worker binds the port itself with ``SO_REUSEPORT``, and the kernel spreads new
connections across the workers' sockets (by a hash of each connection's addresses).

``SO_REUSEPORT`` would also let a second server on the same port share it silently, and two servers on
two databases behind one port would hand out the same lock twice. So the supervisor first binds the port
*without* it: if anything listens there (another lockledger included), startup fails instead. Then it
only supervises: it starts a worker again when one dies, stops them all on SIGINT or SIGTERM, and gives
up when workers keep dying right after they start (a database that cannot be reached, say).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import time
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

log = logging.getLogger("uvicorn.error")

# A worker that dies sooner than this after it started counts as failing to start; this many such
# deaths in a row stop the server (otherwise they would be restarted forever).
QUICK_DEATH_S = 10.0
QUICK_DEATHS_TO_GIVE_UP = 3
STOP_TIMEOUT_S = 15.0


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


def _serve_one(config: uvicorn.Config) -> None:
    """One worker process: its socket, then uvicorn's server until SIGINT or SIGTERM."""
    config.configure_logging()  # a spawned process starts without the parent's logging set-up
    uvicorn.Server(config).run(sockets=[worker_socket(config.host, config.port)])


class Supervisor:
    """Runs ``workers`` processes of ``config`` (its app an import string) until told to stop."""

    def __init__(self, config: uvicorn.Config, workers: int) -> None:
        self.config = config
        self.workers = workers
        self._context = multiprocessing.get_context("spawn")
        self._processes: list[tuple[BaseProcess, float]] = []  # each with the time it started
        self._stopping = False

    def run(self) -> int:
        """Serve until SIGINT or SIGTERM; the exit status (1 when workers kept failing to start)."""
        self.config.port = claim_port(self.config.host, self.config.port)
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._processes = [self._start() for _ in range(self.workers)]
            return self._supervise()
        finally:
            self._stop_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def _start(self) -> tuple[BaseProcess, float]:
        process = self._context.Process(target=_serve_one, args=(self.config,), name="lockledger-worker")
        process.start()
        return process, time.monotonic()

    def _supervise(self) -> int:
        quick_deaths = 0
        while not self._stopping:
            time.sleep(0.2)
            for index, (process, started) in enumerate(self._processes):
                if self._stopping or process.is_alive():
                    continue
                quick_deaths = quick_deaths + 1 if time.monotonic() - started < QUICK_DEATH_S else 0
                if quick_deaths >= QUICK_DEATHS_TO_GIVE_UP:
                    log.error("workers keep exiting as they start (last: %s); stopping", process.exitcode)
                    return 1
                log.warning("worker %s exited with %s; starting another", process.pid, process.exitcode)
                self._processes[index] = self._start()
        return 0

    def _stop_all(self) -> None:
        """SIGTERM every worker (uvicorn finishes what it serves), SIGKILL any still running after that."""
        for process, _ in self._processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process, _ in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
