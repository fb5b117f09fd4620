"""The CLI on the embedded PostgreSQL, as a new user meets it: `serve` on a taken port says so before it
starts anything; a command run beside a `serve` uses the server that serve runs and leaves it running;
`reaper` and `psql` work without a database URL; a server left behind by a killed process is stopped by
`make clean`'s script, and one in use is not.

Every test runs real `lockledger` processes on a data directory of its own (not a storage test: none
uses the suite's database)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from eventstore import embedded
from tests.servers import free_port

pytestmark = pytest.mark.slow

EMBEDDED_SCRIPT = Path(embedded.__file__)
# Neither a database URL nor a data directory or port from the environment of whoever runs the tests.
ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("LOCKLEDGER_DATABASE_URL", "LOCKLEDGER_DATA_DIR", "LOCKLEDGER_PORT")
}


def _lockledger(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args],
        env=env or ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _postgres_on(data_dir: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "postgres" and str(data_dir) in (process.info["cmdline"] or []):
            found.append(process)
    return found


def _gone(data_dir: Path) -> bool:
    """Whether no PostgreSQL runs on ``data_dir`` (waiting a bounded while for one that is stopping)."""
    deadline = time.monotonic() + 15
    while _postgres_on(data_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _postgres_on(data_dir) and embedded.running(data_dir) is None


def _kill_leftovers(data_dir: Path) -> None:
    for leftover in _postgres_on(data_dir):
        leftover.kill()


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "pgdata"
    yield directory
    _kill_leftovers(directory)


def _serve(data_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A `lockledger serve` on the embedded server of ``data_dir``, once it answers /readyz."""
    port = free_port()
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve", "--dev", "--no-reaper", "--port", str(port),
             "--data-dir", str(data_dir)],
            env=ENV, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve exited early: {log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError("serve was not ready within 60 s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.mark.parametrize("how", ["option", "environment"])
def test_serve_on_a_taken_port_says_so_and_starts_nothing(data_dir: Path, how: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--dev", "--data-dir", str(data_dir)]
        if how == "option":
            result = _lockledger(*args, "--port", str(port))
        else:
            result = _lockledger(*args, env={**ENV, "LOCKLEDGER_PORT": str(port)})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"port {port} on 127.0.0.1 is in use (another lockledger?); "
        "choose another with --port N or `make run PORT=N`"
    ]
    assert not data_dir.exists(), "PostgreSQL must not be started (nor its data directory made)"


def test_a_command_beside_serve_uses_its_server_and_leaves_it_running(data_dir: Path, tmp_path: Path) -> None:
    serve, port = _serve(data_dir, tmp_path / "serve.log")
    try:
        server = embedded.running(data_dir)
        assert server is not None

        created = _lockledger("tokens", "create", "--name", "agv-17", "--role", "agent",
                              "--data-dir", str(data_dir))  # fmt: skip
        assert created.returncode == 0, created.stderr
        assert f"using the embedded PostgreSQL already running in {data_dir} (pid {server.pid})" in (
            created.stderr
        )
        assert "starting" not in created.stderr
        assert created.stdout.strip().startswith("llt_")

        selected = _lockledger("psql", "--data-dir", str(data_dir), "-tA", "-c",
                               "select name from api_tokens")  # fmt: skip
        assert selected.returncode == 0, selected.stderr
        assert selected.stdout.split() == ["agv-17"]

        url = _lockledger("database-url", "--data-dir", str(data_dir))
        assert url.stdout.strip() == server.url()

        # the same postmaster still runs, still held by serve alone, and serve still answers
        still = embedded.running(data_dir)
        assert still is not None
        assert (still.pid, still.holders) == (server.pid, (serve.pid,))
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
    finally:
        _stop(serve)
    assert _gone(data_dir), "serve, the last holder, stops the server when it ends"
    assert _lockledger("database-url", "--data-dir", str(data_dir)).returncode == 1


@pytest.mark.parametrize(
    ("stop", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 0)], ids=["sigterm", "sigint"]
)
def test_reaper_runs_on_the_embedded_server_and_stops_it(
    data_dir: Path, tmp_path: Path, stop: signal.Signals, status: int
) -> None:
    log = tmp_path / "reaper.log"
    with log.open("wb") as stderr:
        reaper = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "reaper", "--data-dir", str(data_dir)],
            env={**ENV, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "running; Ctrl-C to stop" not in log.read_text() and time.monotonic() < deadline:
            assert reaper.poll() is None, log.read_text()
            time.sleep(0.1)
        assert "running; Ctrl-C to stop" in log.read_text()
        server = embedded.running(data_dir)
        assert server is not None
        assert server.holders == (reaper.pid,)
        # it works: the schema is there and the reaper has registered its pass
        tables = _lockledger("psql", "--data-dir", str(data_dir), "-tA", "-c", "select count(*) from events")
        assert tables.returncode == 0, tables.stderr
        assert reaper.poll() is None

        reaper.send_signal(stop)
        try:
            assert reaper.wait(timeout=30) == status
        except subprocess.TimeoutExpired:
            # It has hung here, rarely and only in whole CI runs: SIGABRT makes faulthandler write every
            # thread's stack to its log, for the failure to show where.
            reaper.send_signal(signal.SIGABRT)
            reaper.wait(10)
            pytest.fail(f"the reaper did not stop within 30 s of {stop.name}:\n{log.read_text()[-6000:]}")
        assert "Traceback" not in log.read_text()
        assert "reaper stopped" in log.read_text(), "it stopped after its pass, not cut off mid-way"
    finally:
        if reaper.poll() is None:
            reaper.kill()
    assert _gone(data_dir)


def test_psql_on_the_embedded_server(data_dir: Path) -> None:
    result = _lockledger("psql", "--data-dir", str(data_dir), "-tA", "-c", "select 1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "1\n"
    assert f"starting the embedded PostgreSQL in {data_dir}" in result.stderr
    assert _gone(data_dir), "a server the command started is stopped when it ends"

    failed = _lockledger("psql", "--data-dir", str(data_dir), "-c", "select * from no_such_table")
    assert failed.returncode == 1  # psql's own status
    assert "no_such_table" in failed.stderr
    assert _gone(data_dir)


def test_make_cleans_script_stops_a_server_left_behind_but_not_one_in_use(
    data_dir: Path, tmp_path: Path
) -> None:
    """`make clean` runs eventstore/embedded.py with the system's python3: no virtual environment."""
    stop = [sys.executable, "-I", str(EMBEDDED_SCRIPT), "stop", str(data_dir)]
    serve, _ = _serve(data_dir, tmp_path / "serve.log")
    try:
        refused = subprocess.run(stop, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert f"is in use by pid {serve.pid}" in refused.stderr
        assert embedded.running(data_dir) is not None

        serve.kill()  # no atexit: the server is left running, held by no one
        serve.wait(timeout=10)
        left = embedded.running(data_dir)
        assert left is not None
        assert left.holders == ()

        stopped = subprocess.run(stop, capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped the embedded PostgreSQL in {data_dir} (pid {left.pid})" in stopped.stdout
        assert _gone(data_dir)
    finally:
        if serve.poll() is None:
            serve.kill()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_stopping_serve_stops_its_embedded_postgres(
    data_dir: Path, tmp_path: Path, stop: signal.Signals
) -> None:
    """Stopped the way an operator or a supervisor does, `serve` stops the PostgreSQL it started (uvicorn
    re-raises SIGTERM after its graceful shutdown; dying of it would skip the handle's release), and the
    lease taken before the stop is there when it serves again."""
    process, port = _serve(data_dir, tmp_path / "serve.log")
    try:
        assert _postgres_on(data_dir), "the embedded PostgreSQL should run while serving"
        acquired = httpx.post(f"http://127.0.0.1:{port}/v1/locks/zone:A3/acquire", json={"owner": "agv-17"})
        assert acquired.status_code == 201
        process.send_signal(stop)
        process.wait(timeout=30)
        assert _gone(data_dir)
    finally:
        if process.poll() is None:
            process.kill()

    again, port = _serve(data_dir, tmp_path / "again.log")
    try:
        state = httpx.get(f"http://127.0.0.1:{port}/v1/locks/zone:A3").json()
        assert state["owner"] == "agv-17"
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(timeout=30)
