"""Both distributions build from a clean copy of the checkout, as a Python user builds them: the server's
wheel (`pip install .`) carries the SDK, the whole command and the license, needs nothing that no package
index holds, and serves; the SDK's (`pip install ./lockledger`) builds outside its package folder.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, stop_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two wheels, built from the files git tracks (a clean checkout's), by name."""
    scratch = tmp_path_factory.mktemp("distributions")
    source = scratch / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).exists():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target, follow_symlinks=False)
    out = scratch / "wheels"
    pip_wheel = ["-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out)]
    subprocess.run(
        [sys.executable, *pip_wheel, ".", "./lockledger"], cwd=source, check=True, capture_output=True
    )
    assert not (source / "lockledger" / "build").exists(), "the SDK built inside its own package folder"
    found = {path.name.split("-")[0]: path for path in out.glob("*.whl")}
    assert set(found) == {"lockledger_server", "lockledger"}, found
    return found


def _wheel(path: Path) -> tuple[set[str], dict[str, list[str]]]:
    """A wheel's file names, and its METADATA's headers (repeated ones as lists)."""
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(metadata).decode())
    headers: dict[str, list[str]] = {}
    for key, value in message.items():
        headers.setdefault(key, []).append(value)
    return names, headers


def test_the_server_wheel_carries_the_sdk_the_command_and_the_license(wheels: dict[str, Path]) -> None:
    names, headers = _wheel(wheels["lockledger_server"])
    for module in (
        "api/app.py",
        "service/lock_service.py",
        "lockledger/client.py",
        "lockledger/_sync/client.py",
        "lockledger/simulate/fleet.py",
        "lockledger_breaker/__init__.py",
    ):
        assert module in names, module
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(wheels["lockledger_server"]) as archive:
        assert "simulate = lockledger.simulate.cli:register" in archive.read(entry_points).decode()
    assert any(name.endswith("licenses/LICENSE") for name in names), sorted(names)[:20]
    assert any(name.startswith("migrations/versions/") for name in names)  # the schema, for `serve`
    # Every requirement is for a distribution a package index holds: none is built from this repository.
    # (An extra may name the server's own other extras: `dev` is `lockledger-server[bench,ha]` and more.)
    required = {re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()
                for req in headers.get("Requires-Dist", []) if "extra ==" not in req}  # fmt: skip
    assert not required & {"lockledger", "lockledger-server"}, required
    assert {"httpx", "stamina", "fastapi", "asyncpg"} <= required


def test_the_sdk_wheel_holds_the_sdk_and_the_license_only(wheels: dict[str, Path]) -> None:
    names, _ = _wheel(wheels["lockledger"])
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"lockledger", "lockledger_breaker"}, tops
    assert {"lockledger/_async/client.py", "lockledger/_sync/client.py"} <= names
    assert not any(name.startswith("lockledger/simulate") for name in names)  # the server's, not an agent's
    assert any(name.endswith("licenses/LICENSE") for name in names)
    assert not any("/build/" in name for name in names)


def test_the_installed_server_wheel_serves(
    wheels: dict[str, Path], database_url: str, tmp_path: Path
) -> None:
    """The server's wheel alone in a new environment (its dependencies come from the test environment's
    site-packages, placed after its own): `lockledger serve` starts and grants a lock."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheels["lockledger_server"])]
    subprocess.run(install, check=True, capture_output=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # A path line, not a site directory: the test environment's editable-install hooks are not loaded.
    (Path(site) / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "LOCKLEDGER_DATABASE_URL": database_url, "LOCKLEDGER_DEV_MODE": "true"}
    serve = [str(venv / "bin" / "lockledger"), "serve", "--port", str(port)]
    process = subprocess.Popen(serve, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
            for _ in range(300):
                assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            resource = f"wheel-{uuid.uuid4().hex[:8]}:zone"
            granted = client.post(f"/v1/locks/{resource}/acquire", json={"owner": "wheel", "ttl_ms": 5000})
            assert granted.status_code == 201, granted.text
    finally:
        stop_process(process)
    where = subprocess.run(
        [str(python), "-c", "import api, lockledger; print(api.__file__); print(lockledger.__file__)"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(Path(path).is_relative_to(venv) for path in where), where
