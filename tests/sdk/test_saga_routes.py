"""Route steps through the SDK against the real server: a step whose locks are one reservation waits for
the whole set holding none of it, takes every zone at once, and gives the set back as the step's locks
are given back, on success and on compensation; the log holds each grant of the set in one transaction,
naming the saga, the step and the reservation the saga's record shows."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx
import pytest

from lockledger import AsyncClient, Client, ValidationError
from lockledger.saga import SagaDefinition, SagaFailed, Step, StepContext, define, get_saga
from tests.assertions import assert_problem
from tests.servers import ServerProcess

AGENT = "agv-1"


def test_a_route_names_each_lock_once_and_is_sent_as_one() -> None:
    with pytest.raises(ValidationError, match="route step"):
        define("twice", [Step("drive", ["zone:1", "zone:1"], route=True)], register=False)
    with pytest.raises(ValidationError, match="route step"):
        define("empty", [Step("drive", [], route=True)], register=False)
    definition = define("route", [Step("drive", ["zone:{a}", "zone:{b}"], route=True)], register=False)
    assert definition.resolve({"a": 1, "b": 2}) == [
        {"name": "drive", "locks": ["zone:1", "zone:2"], "route": True}
    ]


class Reserves(httpx.AsyncHTTPTransport):
    """Sends every request; ``sent`` is set once a reserve has gone out."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/reservations":
            self.sent.set()
        return await super().handle_async_request(request)


async def _state(http: httpx.AsyncClient, resource: str) -> tuple[str, str | None]:
    answer = await http.get(f"/v1/locks/{resource}")
    if answer.status_code == 404:  # never locked
        return "free", None
    body = answer.json()
    return body["status"], body.get("owner") if body["status"] == "held" else None


async def _grants(admin_pool: asyncpg.Pool, zones: list[str], event_type: str) -> list[asyncpg.Record]:
    return await admin_pool.fetch(
        "SELECT stream_id, tx_id::text AS tx, metadata ->> 'saga_id' AS saga,"
        " metadata ->> 'saga_step' AS step, metadata ->> 'reservation_id' AS reservation"
        " FROM events WHERE stream_id = ANY($1::text[]) AND event_type = $2 ORDER BY position",
        zones,
        event_type,
    )


def _batches(rows: list[asyncpg.Record]) -> list[set[str]]:
    """The zones of each transaction, in log order."""
    batches: dict[str, set[str]] = {}
    for row in rows:
        batches.setdefault(row["tx"], set()).add(row["stream_id"])
    return list(batches.values())


@pytest.mark.storage
async def test_a_route_step_waits_holding_none_then_takes_every_zone_in_one_transaction(
    server: ServerProcess, http: httpx.AsyncClient, admin_pool: asyncpg.Pool, unique_prefix: str
) -> None:
    zones = [f"{unique_prefix}zone:{n}" for n in (1, 2, 3)]
    held = (await http.post(f"/v1/locks/{zones[1]}/acquire", json={"owner": "agv-7"})).json()
    seen: dict[str, Any] = {}

    async def drive(ctx: StepContext) -> dict[str, Any]:
        seen["tokens"] = {zone: ctx.fencing_token(zone) for zone in zones}
        seen["states"] = [await _state(http, zone) for zone in zones]
        return {"at": zones[-1]}

    definition = define(
        f"route-{unique_prefix}",
        [Step("drive", zones, drive, timeout=30.0, route=True)],
        register=False,
    )
    saga_id = f"{unique_prefix}route"
    transport = Reserves()
    async with AsyncClient(server.base_url, agent_id=AGENT, transport=transport) as client:
        async with client.saga(saga_id, definition) as saga:
            driving = asyncio.create_task(saga.step("drive"))
            await asyncio.wait_for(transport.sent.wait(), 20)
            # Waiting for zone 2: the free zones on the route are not taken meanwhile.
            assert [await _state(http, zone) for zone in zones] == [
                ("free", None),
                ("held", "agv-7"),
                ("free", None),
            ]
            assert not driving.done()
            released = {"owner": "agv-7", "fencing_token": held["fencing_token"]}
            await http.post(f"/v1/locks/{zones[1]}/release", json=released)
            assert await asyncio.wait_for(driving, 30) == {"at": zones[-1]}
        view = await get_saga(client, saga_id)

    assert seen["states"] == [("held", AGENT)] * 3  # every zone at once, while the action ran
    assert seen["tokens"] == {zones[0]: 1, zones[1]: 3, zones[2]: 1}  # zone 2: after agv-7's lease
    assert [await _state(http, zone) for zone in zones] == [("free", None)] * 3  # released on completion
    assert view.status == "completed"
    step = view.step("drive")
    assert step.route
    assert step.reservation_id is not None
    [started] = [event for event in view.timeline if event.type == "STEP_STARTED"]
    assert started.data["reservation_id"] == step.reservation_id

    grants = [row for row in await _grants(admin_pool, zones, "LOCK_ACQUIRED") if row["saga"]]
    assert _batches(grants) == [set(zones)]  # one transaction for the whole route
    assert {(row["saga"], row["step"], row["reservation"]) for row in grants} == {
        (saga_id, "drive", step.reservation_id)
    }
    releases = await _grants(admin_pool, zones, "LOCK_RELEASED")
    assert _batches([row for row in releases if row["saga"]]) == [set(zones)]


def _failing_after_the_route(prefix: str, zones: list[str], keep: bool, log: list[Any]) -> SagaDefinition:
    async def drive(ctx: StepContext) -> dict[str, Any]:
        log.append(("drive", sorted(ctx.reservations)))
        return {"tokens": {zone: ctx.fencing_token(zone) for zone in zones}}

    async def drive_back(result: dict[str, Any] | None) -> None:
        log.append(("drive back", result))

    async def unload(ctx: StepContext) -> None:
        log.append(("unload", sorted(ctx.reservations)))
        raise RuntimeError("forks jammed")

    return define(
        f"route-fails-{prefix}",
        [
            Step("drive", zones, drive, drive_back, timeout=10.0, keep=keep, route=True),
            Step("unload", [f"{prefix}dock"], unload, timeout=10.0),
        ],
        register=False,
    )


async def _run(client: AsyncClient, saga_id: str, definition: SagaDefinition) -> None:
    async with client.saga(saga_id, definition) as saga:
        for step in definition.steps:
            await saga.step(step.name)


@pytest.mark.storage
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "released-after-its-step"])
async def test_a_later_step_failing_compensates_the_route_and_releases_its_leases(
    server: ServerProcess,
    http: httpx.AsyncClient,
    admin_pool: asyncpg.Pool,
    unique_prefix: str,
    keep: bool,
) -> None:
    """A kept route is still held when the later step fails and is compensated under it; a route given
    back when its step completed is taken again, as one reservation, for its compensation."""
    zones = [f"{unique_prefix}zone:{n}" for n in (1, 2, 3)]
    log: list[Any] = []
    saga_id = f"{unique_prefix}undo"
    async with AsyncClient(server.base_url, agent_id=AGENT) as client:
        definition = _failing_after_the_route(unique_prefix, zones, keep, log)
        with pytest.raises(SagaFailed) as failed:
            await _run(client, saga_id, definition)
        view = await get_saga(client, saga_id)

    assert failed.value.step == "unload"
    assert view.status == "aborted"
    assert [s.status for s in view.steps] == ["compensated", "failed"]
    assert log[0] == ("drive", ["drive"])
    assert log[1] == ("unload", ["drive"] if keep else [])
    assert log[2] == ("drive back", view.step("drive").result)
    assert [await _state(http, zone) for zone in zones] == [("free", None)] * 3

    grants = await _grants(admin_pool, zones, "LOCK_ACQUIRED")
    assert _batches(grants) == [set(zones)] * (1 if keep else 2)  # the compensation's: one set again
    assert {(row["saga"], row["step"]) for row in grants} == {(saga_id, "drive")}
    assert {row["reservation"] for row in grants} == {view.step("drive").reservation_id}
    assert len(await _grants(admin_pool, zones, "LOCK_RELEASED")) == len(grants)


@pytest.mark.storage
def test_the_blocking_twin_takes_a_route_too(server: ServerProcess, unique_prefix: str) -> None:
    zones = [f"{unique_prefix}zone:{n}" for n in (1, 2)]
    tokens: list[int] = []

    def drive(ctx: StepContext) -> None:
        tokens.extend(ctx.fencing_token(zone) for zone in zones)

    definition = define(
        f"sync-route-{unique_prefix}", [Step("drive", zones, drive, route=True)], register=False
    )
    with Client(server.base_url, agent_id=AGENT) as client:
        with client.saga(f"{unique_prefix}sync", definition) as saga:
            saga.step("drive")
        assert saga.view is not None
        assert saga.view.status == "completed"
        assert [lock.resource for lock in client.iter_locks(prefix=unique_prefix)] == []
    assert tokens == [1, 1]


@pytest.mark.storage
async def test_the_api_refuses_a_route_naming_a_lock_twice_and_shows_a_routes_reservation(
    http: httpx.AsyncClient, unique_prefix: str
) -> None:
    owner = f"{unique_prefix}agv"  # its saga is left running: no other test's agent recovers it
    twice = {"name": "drive", "locks": [f"{unique_prefix}z", f"{unique_prefix}z"], "route": True}
    refused = await http.post("/v1/sagas", json={"name": "n", "owner": owner, "steps": [twice]})
    assert_problem(refused, 422, "validation_error")

    steps = [{"name": "pick", "locks": [f"{unique_prefix}p"]}, {**twice, "locks": [f"{unique_prefix}z"]}]
    started = await http.post(
        "/v1/sagas", json={"saga_id": f"{unique_prefix}s", "name": "n", "owner": owner, "steps": steps}
    )
    assert started.status_code == 201, started.text
    pick, drive = started.json()["steps"]
    assert (pick["route"], pick["reservation_id"]) == (False, None)
    assert drive["route"] is True
    assert drive["reservation_id"]
    shown = (await http.get(f"/v1/sagas/{unique_prefix}s")).json()
    assert shown["steps"][1]["reservation_id"] == drive["reservation_id"]


@pytest.mark.storage
async def test_a_resumed_saga_takes_back_its_kept_route_instead_of_a_second_set(
    server: ServerProcess, http: httpx.AsyncClient, unique_prefix: str
) -> None:
    """The first orchestrator stops after the route step (its set kept, live); a second one with the same
    agent id recovers the saga forward: the reserve replays, the set is renewed whole, not taken again."""
    zones = [f"{unique_prefix}zone:{n}" for n in (1, 2)]
    ran: list[str] = []

    async def act(ctx: StepContext) -> dict[str, Any]:
        ran.append(ctx.step)
        return {"tokens": [ctx.fencing_token(zone) for zone in zones]}

    definition = define(
        f"route-resume-{unique_prefix}",
        [Step("drive", zones, act, keep=True, route=True), Step("unload", [f"{unique_prefix}dock"], act)],
        policy="forward",
        register=False,
    )
    saga_id = f"{unique_prefix}resume"
    agent = f"{unique_prefix}agv"  # recovery finishes every saga of its agent: this test's alone
    async with AsyncClient(server.base_url, agent_id=agent) as first:
        saga = first.saga(saga_id, definition)
        await saga.__aenter__()
        await saga.step("drive")
        for task in saga.routes["drive"]._tasks:  # the first orchestrator dies: no more renewals
            task.cancel()
        async with AsyncClient(server.base_url, agent_id=agent) as second:
            [view] = await second.recover_sagas([definition])
        await saga._stop_beating()

    assert view.status == "completed"
    assert ran == ["drive", "unload"]
    for zone in zones:
        history = (await http.get(f"/v1/locks/{zone}/history")).json()["events"]
        types = [event["type"] for event in history]
        assert types.count("LOCK_ACQUIRED") == 1  # the set was taken once
        assert "LOCK_RENEWED" in types  # and renewed by the second orchestrator before it was trusted
        assert await _state(http, zone) == ("free", None)
