"""Slowloris against a real `lockledger serve` whose open-file limit is lowered below the attack's size:
health checks, readiness and commands from other clients are still answered while more slow connections
are open than the process may open files, each slow connection is closed after the head deadline (408)
or displaced at the connection cap (503), and the server logs that in a few lines, not one per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, stop_process

pytestmark = pytest.mark.storage

FILE_LIMIT = 256
SLOW_CONNECTIONS = 300  # more than the server may open files
HEAD_TIMEOUT_S = 1.0
GENEROUS_S = 20.0  # a bound on waits that should end much sooner, never an expectation


@dataclass
class LimitedServer:
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _lower_file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))


@pytest.fixture(scope="module")
def limited_server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LimitedServer]:
    """`lockledger serve` with at most FILE_LIMIT open files and a short head deadline."""
    port = free_port()
    env = {
        **os.environ,
        "LOCKLEDGER_DATABASE_URL": database_url,
        "LOCKLEDGER_DEV_MODE": "true",
        "LOCKLEDGER_REAPER_ENABLED": "false",
        "LOCKLEDGER_HTTP_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
    }
    env.pop("LOCKLEDGER_HTTP_MAX_CONNECTIONS", None)  # the default: derived from the open-file limit
    log_path = tmp_path_factory.mktemp("slow-clients") / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_lower_file_limit,
        )
    server = LimitedServer(port, process, log_path)
    try:
        deadline = time.monotonic() + GENEROUS_S
        while True:
            assert process.poll() is None, f"lockledger serve exited:\n{server.log()}"
            assert time.monotonic() < deadline, f"lockledger serve did not become ready:\n{server.log()}"
            try:
                if httpx.get(f"{server.base_url}/readyz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield server
    finally:
        stop_process(process)


@dataclass
class Attack:
    """What the slow connections saw."""

    answers: Counter[tuple[int, str]] = field(default_factory=Counter)  # (status, problem code)
    retry_after: set[str] = field(default_factory=set)
    open_now: int = 0
    most_open: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def _slow_connection(port: int, attack: Attack) -> None:
    """Open a connection, send a request head a header line every 0.25 s, never end it; note the answer
    when the server closes it; open another after a pause. Until told to stop."""
    while not attack.stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        attack.open_now += 1
        attack.most_open = max(attack.most_open, attack.open_now)
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            line = 0
            while not attack.stop.is_set():
                try:
                    first = await asyncio.wait_for(reader.read(65_536), 0.25)
                except TimeoutError:
                    writer.write(b"X-Slow-%d: x\r\n" % line)
                    line += 1
                    continue
                if first:
                    _note_answer(first + await asyncio.wait_for(reader.read(), GENEROUS_S), attack)
                break
        except (OSError, TimeoutError):
            pass
        finally:
            attack.open_now -= 1
            writer.close()
        await asyncio.sleep(random.uniform(0.2, 0.8))


def _note_answer(answer: bytes, attack: Attack) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    status = int(lines[0].split()[1])
    code = json.loads(body)["code"] if headers.get("content-type") == "application/problem+json" else ""
    attack.answers[status, code] += 1
    if "retry-after" in headers:
        attack.retry_after.add(headers["retry-after"])


async def _until(condition: object, what: str) -> None:
    assert callable(condition)
    deadline = time.monotonic() + GENEROUS_S
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _slowloris(port: int, connections: int) -> AsyncIterator[Attack]:
    attack = Attack()
    slow = [asyncio.create_task(_slow_connection(port, attack)) for _ in range(connections)]
    try:
        yield attack
    finally:
        attack.stop.set()
        await asyncio.gather(*slow, return_exceptions=True)


async def _served(base_url: str, rounds: int, resource: str) -> None:
    """Health, readiness and a command, each from a fresh client (a new connection) every time."""
    for round_ in range(rounds):
        async with httpx.AsyncClient(base_url=base_url, timeout=GENEROUS_S) as client:
            health = await client.get("/healthz")
            assert health.status_code == 200, health.text
        async with httpx.AsyncClient(base_url=base_url, timeout=GENEROUS_S) as client:
            assert (await client.get("/readyz")).status_code == 200  # the pool still has its files
        async with httpx.AsyncClient(base_url=base_url, timeout=GENEROUS_S) as client:
            acquired = await client.post(
                f"/v1/locks/{resource}-{round_}/acquire", json={"owner": "bystander", "ttl_ms": 5_000}
            )
            assert acquired.status_code == 201, acquired.text
        await asyncio.sleep(0.1)


def test_other_clients_are_served_through_a_slowloris_attack(
    limited_server: LimitedServer, resource: str
) -> None:
    base, port = limited_server.base_url, limited_server.port

    async def over_the_cap() -> Attack:
        """More slow connections than the process may open files: the newest displace the oldest."""
        async with _slowloris(port, SLOW_CONNECTIONS) as attack:
            await _until(lambda: attack.most_open > FILE_LIMIT, "the slow connections did not all open")
            await _served(base, 5, f"{resource}-over")
            await _until(
                lambda: attack.answers[503, "unavailable"] >= 10, f"none displaced: {attack.answers}"
            )
        return attack

    async def under_the_cap() -> Attack:
        """Fewer: each is closed at the head deadline."""
        async with _slowloris(port, 50) as attack:
            await _served(base, 2, f"{resource}-under")
            await _until(
                lambda: attack.answers[408, "request_timeout"] >= 10, f"none timed out: {attack.answers}"
            )
        return attack

    over = asyncio.run(over_the_cap())
    assert over.most_open > FILE_LIMIT
    assert set(over.answers) <= {(408, "request_timeout"), (503, "unavailable")}, over.answers
    assert over.retry_after == {"1"}  # on every 503
    under = asyncio.run(under_the_cap())
    assert set(under.answers) == {(408, "request_timeout")}, under.answers

    assert limited_server.process.poll() is None
    log = limited_server.log()
    assert "Too many open files" not in log
    # Logged, in a few lines that each count many closings rather than a line per connection.
    timed_out = over.answers[408, "request_timeout"] + under.answers[408, "request_timeout"]
    assert 1 <= log.count("request head not received in time") < timed_out
    assert 1 <= log.count("connection cap reached") < over.answers[503, "unavailable"]


def test_a_malformed_request_to_the_server_is_answered_400_problem_json(
    limited_server: LimitedServer,
) -> None:
    async def exchange() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", limited_server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), GENEROUS_S)  # to the end: the server closes
        writer.close()
        return answer

    answer = asyncio.run(exchange())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"content-type: application/problem+json" in head
    problem = json.loads(body)
    assert (problem["status"], problem["code"]) == (400, "bad_request")
