"""What a real `lockledger serve` (authentication on) writes to its log, stdout and stderr both, while
clients with real API tokens misbehave in the two ways a security run found tokens in the log:

- an authenticated acquire whose client hangs up half-way through its body (Starlette's
  ``ClientDisconnect``), and
- a change-feed reader (a dashboard's token) that stops reading: its connection's write buffer stays
  full until the write deadline cuts it (it catches up on a backlog larger than the socket buffers:
  tests/hostile_clients.py).

Each is one line (info for the hang-up, warning for the cut) with the path and the reason, never a
traceback, and no token appears anywhere in the output.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from domain.access import Role
from service.lock_service import LockService
from tests.hostile_clients import backlog, hang_up_mid_body, log_lines, stalled_reader
from tests.servers import IssueToken, ServerProcess, free_port

pytestmark = [pytest.mark.storage, pytest.mark.slow]

WAIT_S = 60.0  # bound on every wait: generous for a shared 2-core machine, never an expectation
HANGUPS = 3


@pytest.fixture(scope="module")
def logged_server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    overrides = {
        "LOCKLEDGER_DEV_MODE": "false",
        "LOCKLEDGER_REAPER_ENABLED": "false",
        "LOCKLEDGER_HTTP_WRITE_TIMEOUT_S": "1",
        "LOCKLEDGER_LOG_LEVEL": "info",
    }
    log_path = tmp_path_factory.mktemp("logging") / "serve.log"
    server = ServerProcess(database_url, free_port(), overrides, log_path=log_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def output(server: ServerProcess) -> str:
    assert server.log_path is not None
    return server.log_path.read_text(errors="replace")


def logged(server: ServerProcess) -> list[dict[str, Any]]:
    assert server.log_path is not None
    return log_lines(server.log_path)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


async def test_hang_ups_and_stalled_feed_readers_are_one_line_each_and_no_token_is_logged(
    logged_server: ServerProcess, issue_token: IssueToken, lock_service: LockService, unique_prefix: str
) -> None:
    name = unique_prefix.rstrip(":")
    agent = await issue_token(f"{name}-agent", Role.AGENT)
    dashboard = await issue_token(f"{name}-dashboard", Role.DASHBOARD)
    port, path = logged_server.port, f"/v1/locks/{unique_prefix}hangup/acquire"

    for _ in range(HANGUPS):
        await asyncio.to_thread(hang_up_mid_body, port, agent, path)
    await backlog(lock_service, unique_prefix)
    reader = stalled_reader(port, dashboard, unique_prefix)
    try:

        def cut() -> bool:
            return any(line.get("reason") == "write_timeout" for line in logged(logged_server))

        await asyncio.to_thread(wait_until, cut, "the stalled reader was not cut")
    finally:
        reader.close()

    def hung_up() -> list[dict[str, Any]]:
        return [line for line in logged(logged_server) if line.get("reason") == "hangup"]

    await asyncio.to_thread(wait_until, lambda: len(hung_up()) == HANGUPS, "hang-ups not logged")
    assert all((line["level"], line["path"]) == ("info", path) for line in hung_up())
    (cut_line,) = [line for line in logged(logged_server) if line.get("reason") == "write_timeout"]
    assert (cut_line["level"], cut_line["path"]) == ("warning", "/v1/events/stream")

    text = output(logged_server)
    assert agent not in text
    assert dashboard not in text
    assert "Traceback" not in text
    assert not [line for line in logged(logged_server) if line["level"] in ("error", "critical")]
    async with httpx.AsyncClient(base_url=logged_server.base_url, timeout=30) as http:
        assert (await http.get("/healthz")).status_code == 200


async def test_no_log_line_renders_a_frames_locals(
    logged_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    """Whatever the server logged in this module, a hang-up of this test's own included: no Rich
    traceback, which shows each frame's locals in boxes (the ASGI scope, its headers)."""
    agent = await issue_token(f"{unique_prefix.rstrip(':')}-frame", Role.AGENT)
    path = f"/v1/locks/{unique_prefix}frame/acquire"
    await asyncio.to_thread(hang_up_mid_body, logged_server.port, agent, path)
    await asyncio.to_thread(
        wait_until, lambda: any(line.get("path") == path for line in logged(logged_server)), "not logged"
    )
    text = output(logged_server)
    assert "locals" not in text
    assert "scope" not in text
    assert "╭" not in text  # Rich's panel corner
