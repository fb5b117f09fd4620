"""The investigator's commands (`lockledger replay`, `history`, `export`) run as processes against a real
server with authentication on: json and csv that parse and hold the lease, tables that show it with its
times in UTC and in the local zone, an export to a file that is valid NDJSON and resumes, refusals told in
one line; and the one `lockledger` command that carries the server's commands too."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from datetime import datetime
from importlib.metadata import EntryPoint
from pathlib import Path

import asyncpg
import pytest
import typer

from domain.access import Role
from lockledger import AsyncClient
from lockledger.client import LeaseInfo
from tests.servers import IssueToken, ServerProcess, free_port

pytestmark = pytest.mark.storage

ROOT = Path(__file__).resolve().parents[2]
# Nothing from the environment of whoever runs the tests; a wide terminal, so table cells stay whole.
ENV = {k: v for k, v in os.environ.items() if k not in ("LOCKLEDGER_URL", "LOCKLEDGER_TOKEN", "COLUMNS")}


def lockledger(
    *args: str, url: str | None = None, token: str | None = None, tz: str = "UTC", stdout: int | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**ENV, "TZ": tz, "COLUMNS": "200"}
    env.update({"LOCKLEDGER_URL": url} if url else {})
    env.update({"LOCKLEDGER_TOKEN": token} if token else {})
    return subprocess.run(
        [sys.executable, "-m", "lockledger.cli", *args],
        env=env, cwd=ROOT, text=True, timeout=120, stdout=stdout or subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


@dataclass
class Scene:
    """A lease taken through the SDK, an instant after it by the database clock, and who may look."""

    url: str
    investigator: str
    owner: str
    lease: LeaseInfo
    after: str  # RFC 3339


@pytest.fixture
async def scene(
    auth_server: ServerProcess, issue_token: IssueToken, admin_pool: asyncpg.Pool, unique_prefix: str
) -> Scene:
    owner = f"{unique_prefix}agv-9"
    async with AsyncClient(auth_server.base_url, token=await issue_token(owner, Role.AGENT)) as agent:
        lease = await agent.acquire(f"{unique_prefix}zone:A3", ttl=60)
        other = await agent.acquire(f"{unique_prefix}zone:B1", ttl=60)
        await agent.release(other.resource, None, other.fencing_token)
    after: datetime = await admin_pool.fetchval("SELECT clock_timestamp()")
    investigator = await issue_token(f"{unique_prefix}investigator", Role.INVESTIGATOR)
    return Scene(auth_server.base_url, investigator, owner, lease, after.isoformat())


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


def test_replay_as_json_and_csv_holds_the_lease(scene: Scene, unique_prefix: str) -> None:
    common = ["--at", scene.after, "--prefix", unique_prefix]
    answer = json.loads(_ok(lockledger("replay", *common, "--format", "json", url=scene.url,
                                       token=scene.investigator)))  # fmt: skip
    (lock,) = answer["locks"]
    assert (lock["resource"], lock["owner"], lock["fencing_token"]) == (
        scene.lease.resource, scene.owner, scene.lease.fencing_token,
    )  # fmt: skip
    assert datetime.fromisoformat(lock["expires_at"]) == scene.lease.expires_at
    assert datetime.fromisoformat(lock["acquired_at"]) <= datetime.fromisoformat(scene.after)
    assert answer["position"] > 0
    assert datetime.fromisoformat(answer["at"]) == datetime.fromisoformat(scene.after)

    # --url and --token as options rather than from the environment
    table = _ok(
        lockledger("replay", *common, "--format", "csv", "--url", scene.url, "--token", scene.investigator)
    )
    rows = list(csv.DictReader(io.StringIO(table)))
    assert [(r["resource"], r["owner"], int(r["fencing_token"])) for r in rows] == [
        (scene.lease.resource, scene.owner, scene.lease.fencing_token)
    ]
    assert datetime.fromisoformat(rows[0]["expires_at"]) == scene.lease.expires_at


def test_replay_as_a_table_shows_the_resource_and_times_in_utc_and_local(
    scene: Scene, unique_prefix: str
) -> None:
    shown = _ok(lockledger("replay", "--at", scene.after, "--prefix", unique_prefix, url=scene.url,
                           token=scene.investigator, tz="Asia/Kolkata"))  # fmt: skip
    assert scene.lease.resource in shown
    assert f"{unique_prefix}zone:B1" not in shown  # released before the instant
    assert scene.owner in shown
    utc = scene.lease.expires_at
    assert f"{utc:%H:%M:%S}" in shown
    assert "UTC" in shown
    assert "IST" in shown  # the same instants in the local zone (UTC+05:30)
    assert "1 lease(s)" in shown


def test_history_of_a_resource_and_of_an_agent(scene: Scene, unique_prefix: str) -> None:
    resource = json.loads(_ok(lockledger("history", scene.lease.resource, "--format", "json", url=scene.url,
                                         token=scene.investigator)))  # fmt: skip
    assert resource["resource"] == scene.lease.resource
    assert [e["type"] for e in resource["events"]] == ["LOCK_ACQUIRED"]

    agent = _ok(lockledger("history", "--agent", scene.owner, "--format", "csv", url=scene.url,
                           token=scene.investigator))  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(agent)))
    assert [(r["resource"], r["type"]) for r in rows] == [
        (scene.lease.resource, "LOCK_ACQUIRED"), (f"{unique_prefix}zone:B1", "LOCK_ACQUIRED"),
        (f"{unique_prefix}zone:B1", "LOCK_RELEASED"),
    ]  # fmt: skip
    assert [int(r["position"]) for r in rows] == sorted(int(r["position"]) for r in rows)
    assert all(json.loads(r["data"])["owner"] == scene.owner for r in rows)

    table = _ok(lockledger("history", "--agent", scene.owner, "--to", scene.after, url=scene.url,
                           token=scene.investigator))  # fmt: skip
    assert f"{unique_prefix}zone:B1" in table
    assert "LOCK_RELEASED" in table
    assert "3 event(s)" in table


async def test_replay_and_history_name_the_reservation_and_tell_a_hand_off(
    scene: Scene,
    auth_server: ServerProcess,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    unique_prefix: str,
) -> None:
    """Two zones reserved together and a pallet handed off then accepted: replay's table and json name the
    reservation of each zone; history marks the reserved events and says who gave the pallet to whom,
    with how long to accept, and that it was accepted."""
    zones = [f"{unique_prefix}trip:A1", f"{unique_prefix}trip:A2"]
    pallet = f"{unique_prefix}trip:pallet"
    receiver = f"{unique_prefix}agv-2"
    async with (
        AsyncClient(auth_server.base_url, token=await issue_token(scene.owner, Role.AGENT)) as agent,
        AsyncClient(auth_server.base_url, token=await issue_token(receiver, Role.AGENT)) as other,
    ):
        await agent.reserve_set(zones, ttl=60, reservation_id="route-7")
        lease = await agent.acquire(pallet, ttl=60)
        await agent.handoff(pallet, None, lease.fencing_token, receiver, accept_within=5)
        await other.accept(pallet, ttl=60)
    after: datetime = await admin_pool.fetchval("SELECT clock_timestamp()")
    common = ["--at", after.isoformat(), "--prefix", f"{unique_prefix}trip:"]

    answer = json.loads(_ok(lockledger("replay", *common, "--format", "json", url=scene.url,
                                       token=scene.investigator)))  # fmt: skip
    assert [(lock["resource"], lock["reservation_id"]) for lock in answer["locks"]] == [
        (zones[0], "route-7"), (zones[1], "route-7"), (pallet, None),
    ]  # fmt: skip
    table = _ok(lockledger("replay", *common, url=scene.url, token=scene.investigator))
    assert "reservation" in table
    assert table.count("route-7") == 2

    shown = _ok(lockledger("history", zones[0], url=scene.url, token=scene.investigator))
    assert "reservation route-7" in shown
    handed = _ok(lockledger("history", pallet, url=scene.url, token=scene.investigator))
    assert f"from {scene.owner} (token {lease.fencing_token}) to {receiver}" in handed
    assert "to accept within 5 s" in handed
    assert "accepted the hand-off" in handed
    assert "reservation" not in handed


async def test_replay_and_history_show_shared_grants(
    scene: Scene,
    auth_server: ServerProcess,
    issue_token: IssueToken,
    admin_pool: asyncpg.Pool,
    unique_prefix: str,
) -> None:
    """A mutex, a read grant of the read/write lock of the same name and a permit of a semaphore of 4:
    replay's table names each kind, its json and csv carry mode and limit, and an agent's history tells
    the grants' mode and limit."""
    zone, bay = f"{unique_prefix}sh:zone", f"{unique_prefix}sh:bay"
    async with AsyncClient(auth_server.base_url, token=await issue_token(scene.owner, Role.AGENT)) as agent:
        await agent.acquire(zone, ttl=60)
        read = await agent.acquire_shared(zone, "shared", None, ttl=60)
        permit = await agent.acquire_shared(bay, "shared", 4, ttl=60)
    after: datetime = await admin_pool.fetchval("SELECT clock_timestamp()")
    common = ["--at", after.isoformat(), "--prefix", f"{unique_prefix}sh:", "--url", scene.url]

    answer = json.loads(_ok(lockledger("replay", *common, "--format", "json", token=scene.investigator)))
    assert [(lock["resource"], lock["mode"], lock["limit"], lock["fencing_token"]) for lock in answer["locks"]
            ] == [(bay, "shared", 4, permit.fencing_token), (zone, None, None, 1),
                  (zone, "shared", None, read.fencing_token)]  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(_ok(lockledger("replay", *common, "--format", "csv",
                                                          token=scene.investigator)))))  # fmt: skip
    assert [(row["mode"], row["limit"]) for row in rows] == [("shared", "4"), ("", ""), ("shared", "")]
    table = _ok(lockledger("replay", *common, token=scene.investigator))
    for kind in ("permit of 4", "mutex", "read"):
        assert kind in table

    shown = _ok(lockledger("history", "--agent", scene.owner, url=scene.url, token=scene.investigator))
    for line in (
        "SHARED_ACQUIRED",
        "shared grant: permit of 4",
        "limit 4",
        "shared grant: read",
        "limit none",
    ):
        assert line in shown


async def test_history_shared_shows_a_shared_locks_grants_and_what_each_event_was_of(
    scene: Scene, auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    """`history RESOURCE --shared`: the shared lock's events, not the mutex's; the table tells each
    grant's kind and limit, and its renewal and release the grant they were of; json and csv carry them;
    --shared with --agent is refused."""
    bay = f"{unique_prefix}sh:bay"
    async with AsyncClient(auth_server.base_url, token=await issue_token(scene.owner, Role.AGENT)) as agent:
        await agent.acquire(bay, ttl=60)  # the mutex of the same name: not in the shared history
        permit = await agent.acquire_shared(bay, "shared", 4, ttl=60)
        await agent.renew_shared(bay, None, permit.fencing_token, ttl=90)
        await agent.release_shared(bay, None, permit.fencing_token)
    common = ["history", bay, "--shared", "--url", scene.url]

    table = _ok(lockledger(*common, token=scene.investigator))
    assert f"History of shared lock {bay}" in table
    for line in ("SHARED_ACQUIRED", "shared grant: permit of 4", "limit 4", "SHARED_RENEWED", "ttl 90 s",
                 "SHARED_RELEASED", "of the permit of 4 grant", "3 event(s)"):  # fmt: skip
        assert line in table, line
    assert "LOCK_ACQUIRED" not in table

    answer = json.loads(_ok(lockledger(*common, "--format", "json", token=scene.investigator)))
    assert answer["resource"] == bay
    assert [(e["type"], e["data"]["fencing_token"]) for e in answer["events"]] == [
        ("SHARED_ACQUIRED", permit.fencing_token), ("SHARED_RENEWED", permit.fencing_token),
        ("SHARED_RELEASED", permit.fencing_token),
    ]  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(_ok(lockledger(*common, "--format", "csv",
                                                          token=scene.investigator)))))  # fmt: skip
    assert [row["resource"] for row in rows] == [f"shared/{bay}"] * 3
    assert json.loads(rows[0]["data"])["limit"] == 4

    refused = lockledger(
        "history", "--agent", scene.owner, "--shared", url=scene.url, token=scene.investigator
    )
    assert refused.returncode == 2
    assert "--shared is for a RESOURCE" in refused.stderr


def test_export_to_a_file_is_ndjson_of_every_event_and_resumes(
    scene: Scene, unique_prefix: str, tmp_path: Path
) -> None:
    target = tmp_path / "events.ndjson"
    with target.open("w") as out:
        result = lockledger("export", "--prefix", unique_prefix, url=scene.url, token=scene.investigator,
                            stdout=out.fileno())  # fmt: skip
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in target.read_text().splitlines()]
    assert [(e["stream"], e["type"]) for e in events] == [
        (scene.lease.resource, "LOCK_ACQUIRED"), (f"{unique_prefix}zone:B1", "LOCK_ACQUIRED"),
        (f"{unique_prefix}zone:B1", "LOCK_RELEASED"),
    ]  # fmt: skip
    positions = [e["position"] for e in events]
    assert positions == sorted(set(positions))
    assert all(len(e["hash"]) == 64 for e in events)
    assert "exported 3 events" in result.stderr

    rest = _ok(lockledger("export", "--prefix", unique_prefix, "--after-position", str(positions[0]),
                          url=scene.url, token=scene.investigator))  # fmt: skip
    assert rest.splitlines() == target.read_text().splitlines()[1:]
    only = _ok(lockledger("export", "--prefix", unique_prefix, "--type", "LOCK_RELEASED", url=scene.url,
                          token=scene.investigator))  # fmt: skip
    assert [json.loads(line)["type"] for line in only.splitlines()] == ["LOCK_RELEASED"]


def _one_line_error(result: subprocess.CompletedProcess[str], status: int = 1) -> str:
    assert result.returncode == status, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.mark.parametrize("role", [Role.DASHBOARD, Role.AGENT])
async def test_a_dashboard_or_agent_token_is_refused_in_one_line(
    scene: Scene, issue_token: IssueToken, unique_prefix: str, role: Role
) -> None:
    token = await issue_token(f"{unique_prefix}{role.value}", role)
    refused = [["history", "--agent", scene.owner], ["export"]]
    if role is Role.AGENT:  # a dashboard may see the fleet at an instant (its time slider), not history
        refused.append(["replay", "--at", scene.after])
    for args in refused:
        line = _one_line_error(lockledger(*args, url=scene.url, token=token))
        assert "403" in line
        assert "investigator" in line


def test_other_failures_are_one_line(scene: Scene) -> None:
    no_token = _one_line_error(lockledger("replay", "--at", scene.after, url=scene.url))
    assert "401" in no_token
    assert "--token" in no_token
    future = _one_line_error(lockledger("replay", "--at", "2999-01-01T00:00:00Z", url=scene.url,
                                        token=scene.investigator))  # fmt: skip
    assert "422" in future
    assert "future" in future
    naive = _one_line_error(lockledger("replay", "--at", "2026-05-05T09:30:00", url=scene.url), status=2)
    assert "offset" in naive
    before_year_1 = lockledger(
        "history", "--agent", "a", "--from", "0001-01-01T00:00:00+14:00", url=scene.url
    )
    assert "outside years 1 to 9999" in _one_line_error(before_year_1, status=2)
    too_fine = lockledger("replay", "--at", "2026-05-05T09:30:00.1234567Z", url=scene.url)
    assert "fractional digits" in _one_line_error(too_fine, status=2)
    nobody = f"http://127.0.0.1:{free_port()}"
    unreachable = _one_line_error(lockledger("export", url=nobody, token=scene.investigator))
    assert f"cannot reach the server at {nobody}" in unreachable


# --- one `lockledger` command ---------------------------------------------------------------------------


@pytest.fixture
def server_commands() -> list[str]:
    """What the root project registers in the `lockledger.cli` entry point group, as `module:function`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    # The server's distribution carries the SDK, and with it the SDK's console script, the same one.
    sdk = tomllib.loads((ROOT / "lockledger" / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["scripts"] == sdk["scripts"] == {"lockledger": "lockledger.cli:main"}
    declared = list(project["entry-points"]["lockledger.cli"].values())
    assert declared == ["api.cli:register", "lockledger.simulate.cli:register"]
    return declared


def test_the_server_commands_join_the_sdks_command(
    server_commands: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main()'s registration, with the entry points the root project declares (and one that is broken:
    it is named on stderr, and every other command still comes)."""
    from lockledger import cli

    declared = [EntryPoint(value.split(".")[0], value, cli.ENTRY_POINT_GROUP) for value in server_commands]
    broken = EntryPoint("broken", "no_such_module_here:register", cli.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        cli, "entry_points", lambda group: [*declared, broken] if group == cli.ENTRY_POINT_GROUP else []
    )
    app = typer.Typer()
    app.registered_commands.extend(cli.app.registered_commands)
    assert cli.register_installed(app) == ["broken"]
    assert "no_such_module_here" in capsys.readouterr().err
    names = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    names |= {g.name or "" for g in app.registered_groups}
    assert {"replay", "history", "export"} <= names
    assert {"serve", "migrate", "reaper", "rebuild", "verify", "tokens", "psql", "database-url"} <= names
    assert "simulate" in names  # the simulator's, carried by the server's distribution


def test_the_help_lists_client_and_server_commands() -> None:
    """`lockledger --help` as main() builds it, with the server's register found as the entry point is."""
    program = "import api.cli, lockledger.cli as c; api.cli.register(c.app); c.app()"
    result = subprocess.run(
        [sys.executable, "-c", program, "--help"], env={**ENV, "COLUMNS": "200"}, cwd=ROOT,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    shown = _ok(result)
    for command in ("replay", "history", "export", "serve", "migrate", "tokens", "database-url"):
        assert f" {command} " in shown
