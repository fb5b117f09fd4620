"""Fault: 20 change-feed readers that never read and 20 authenticated mid-body hang-ups per second,
against a real `lockledger serve` with authentication on.

These are expected client behaviours, so the server must log them in lines without a traceback, keep
every token out of its log, go on answering others, and let go of what each stalled reader held once its
write deadline cuts it. Nothing here asserts a duration; the memory figure is printed for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import httpx
import psutil
import pytest

from domain.access import Role
from service.lock_service import LockService
from tests.faults.processes import ServerFactory
from tests.hostile_clients import BACKLOG_EVENTS, backlog, hang_up_mid_body, log_lines, stalled_reader
from tests.servers import IssueToken

pytestmark = [pytest.mark.storage, pytest.mark.slow]

READERS = 20
HANGUPS_PER_S = 20
WAIT_S = 120.0  # bound on waits: generous for a shared 2-core machine, never an expectation


async def _metric(http: httpx.AsyncClient, sample: str) -> float:
    """A sample of the server's /metrics, e.g. ``name{label="value"}``; 0 when absent."""
    text = (await http.get("/metrics")).text
    prefix = f"{sample} "
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


async def _closed(http: httpx.AsyncClient, reason: str) -> float:
    return await _metric(http, f'lockledger_http_connections_closed_total{{reason="{reason}"}}')


async def _hang_ups(port: int, token: str, path: str, stop: asyncio.Event) -> int:
    sent = 0
    while not stop.is_set():
        await asyncio.to_thread(hang_up_mid_body, port, token, path)
        sent += 1
        await asyncio.sleep(1 / HANGUPS_PER_S)
    return sent


async def _probe(http: httpx.AsyncClient, resource: str, stop: asyncio.Event, rounds: int = 0) -> list[str]:
    """/healthz and an acquire+release of the probe's own lock, until ``stop`` (at least ``rounds``
    times); the failures."""
    failures: list[str] = []
    done_rounds = 0
    while done_rounds < rounds or not stop.is_set():
        done_rounds += 1
        health = await http.get("/healthz")
        if health.status_code != 200:
            failures.append(f"/healthz {health.status_code}")
        got = await http.post(f"/v1/locks/{resource}/acquire", json={"ttl_ms": 10_000})
        if got.status_code != 201:
            failures.append(f"acquire {got.status_code} {got.text}")
            continue
        done = await http.post(
            f"/v1/locks/{resource}/release", json={"fencing_token": got.json()["fencing_token"]}
        )
        if done.status_code != 200:
            failures.append(f"release {done.status_code} {done.text}")
        await asyncio.sleep(0.05)
    return failures


async def _read_backlog(http: httpx.AsyncClient, token: str, prefix: str) -> None:
    """A change-feed reader that does read: the backlog of ``prefix`` to its end, then it hangs up."""
    url = f"/v1/events/stream?after_position=0&prefix={prefix}"
    received = 0
    async with http.stream("GET", url, headers={"Authorization": f"Bearer {token}"}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            received += line.startswith("id:")
            if received == BACKLOG_EVENTS:
                return


async def _round(
    http: httpx.AsyncClient, port: int, agent: str, dashboard: str, prefix: str
) -> tuple[int, list[str]]:
    """One hostile round: READERS stalled readers until the write deadline has cut them all, with
    hang-ups and the probe meanwhile; the hang-ups sent and the probe's failures."""
    cut_before = await _closed(http, "write_timeout")
    stop = asyncio.Event()
    hang_ups = asyncio.create_task(_hang_ups(port, agent, f"/v1/locks/{prefix}hangup/acquire", stop))
    probe = asyncio.create_task(_probe(http, f"{prefix}probe", stop))
    readers: list[socket.socket] = []
    try:
        for _ in range(READERS):
            readers.append(stalled_reader(port, dashboard, prefix))
        deadline = time.monotonic() + WAIT_S
        while await _closed(http, "write_timeout") - cut_before < READERS:
            assert time.monotonic() < deadline, "the stalled readers were not all cut"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        sent = await hang_ups
        failures = await probe
        for sock in readers:
            with contextlib.suppress(OSError):
                sock.close()
    await asyncio.sleep(1.0)  # the readers' streams have ended, their queues are garbage
    return sent, failures


async def test_stalled_readers_and_hang_ups_log_no_token_and_no_traceback(
    database_url: str,
    unique_prefix: str,
    start_server: ServerFactory,
    issue_token: IssueToken,
    lock_service: LockService,
) -> None:
    server = start_server(
        database_url,
        {
            "LOCKLEDGER_DEV_MODE": "false",
            "LOCKLEDGER_REAPER_ENABLED": "false",
            "LOCKLEDGER_HTTP_WRITE_TIMEOUT_S": "1",
        },
    )
    assert server.process is not None
    assert server.log_path is not None
    name = unique_prefix.rstrip(":")
    agent = await issue_token(f"{name}-agent", Role.AGENT)
    dashboard = await issue_token(f"{name}-dashboard", Role.DASHBOARD)
    await backlog(lock_service, unique_prefix)
    headers = {"Authorization": f"Bearer {agent}"}
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=30) as http:
        warm = asyncio.Event()
        warm.set()  # one round of the probe: the command path and /healthz have run once
        assert not await _probe(http, f"{unique_prefix}probe", warm, rounds=1)
        pid = server.process.pid
        rss_cold = psutil.Process(pid).memory_info().rss
        # What any first burst of readers warms (the read pool's connections and their statement caches),
        # by as many readers that do read.
        await asyncio.gather(*(_read_backlog(http, dashboard, unique_prefix) for _ in range(READERS)))
        # Round 2 shows whether cut readers leave memory held once round 1 has found the allocator's
        # high-water mark.
        rss_start = psutil.Process(pid).memory_info().rss
        sent, failures = await _round(http, server.port, agent, dashboard, unique_prefix)
        rss_before = psutil.Process(pid).memory_info().rss
        more, failed_again = await _round(http, server.port, agent, dashboard, unique_prefix)
        rss_after = psutil.Process(pid).memory_info().rss
        sent += more
        failures += failed_again
        assert await _metric(http, "lockledger_feed_subscriptions") == 0
        assert (await http.get("/healthz")).status_code == 200

    assert not failures, failures[:5]
    log_path = server.log_path
    deadline = time.monotonic() + WAIT_S
    while sum(line.get("reason") == "hangup" for line in log_lines(log_path)) < sent:
        assert time.monotonic() < deadline, "not every hang-up was logged"
        await asyncio.sleep(0.2)
    text = log_path.read_text(errors="replace")
    assert agent not in text
    assert dashboard not in text
    assert "Traceback" not in text
    lines = log_lines(log_path)
    assert not [line for line in lines if line["level"] in ("error", "critical")]
    assert sum(line.get("reason") == "hangup" for line in lines) == sent  # one line each
    mib = 2**20
    print(
        f"hostile clients: 2 rounds of {READERS} stalled readers cut, {sent} hang-ups; server RSS"
        f" {rss_cold / mib:.1f} MiB cold, {rss_start / mib:.1f} after {READERS} readers that read,"
        f" {rss_before / mib:.1f} after round 1"
        f" ({(rss_before - rss_start) / mib:+.1f}), {rss_after / mib:.1f} after round 2"
        f" ({(rss_after - rss_before) / mib:+.1f} MiB)"
    )
