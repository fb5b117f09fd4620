"""Fixtures of the fault scenarios: the private PostgreSQL, and servers and reapers that are always
stopped when a scenario ends, however it ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.postgres import PrivatePostgres
from tests.faults.processes import ReaperFactory, ReaperProcess, ServerFactory
from tests.servers import ServerProcess, free_port


@pytest.fixture(scope="package")
def private_postgres() -> Iterator[PrivatePostgres]:
    """An embedded PostgreSQL of this package's own, to stop and freeze at will."""
    server = PrivatePostgres()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """Start `lockledger serve` subprocesses (dev mode, 127.0.0.1); all are stopped at teardown."""
    servers: list[ServerProcess] = []

    def start(database_url: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(
            database_url, free_port(), dict(env or {}), log_path=tmp_path / f"serve-{len(servers)}.log"
        )
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def start_reaper(tmp_path: Path) -> Iterator[ReaperFactory]:
    """Start standalone `lockledger reaper` subprocesses; all are stopped at teardown."""
    reapers: list[ReaperProcess] = []

    def start(database_url: str) -> ReaperProcess:
        reaper = ReaperProcess(
            database_url,
            tmp_path / f"reaper-{len(reapers)}.log",
            {"LOCKLEDGER_REAPER_INTERVAL_MS": "100"},
        )
        reapers.append(reaper)
        reaper.start()
        return reaper

    yield start
    for reaper in reapers:
        reaper.stop()
