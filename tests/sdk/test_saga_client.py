"""Sagas through the SDK against the real server: a saga that completes, one whose step fails and is
compensated in reverse, the locks a saga holds and gives back, and the derived Idempotency-Keys that keep
a retried or resumed step from taking a second lock. The first tests need no server: definitions and
keys are checked before anything is sent."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import pytest

from domain.access import Role
from lockledger import AsyncClient, Client, LockLedgerError, ValidationError
from lockledger.saga import (
    AsyncSaga,
    SagaDefinition,
    SagaFailed,
    SagaStuck,
    Step,
    StepContext,
    _key,
    define,
    get_saga,
    registry,
)
from tests.servers import IssueToken, ServerProcess

# --- without a server ----------------------------------------------------------------------------------


def test_a_definition_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValidationError, match="unique"):
        define("twice", [Step("a"), Step("a")], register=False)
    with pytest.raises(ValidationError, match="step name"):
        define("slash", [Step("a/b")], register=False)
    with pytest.raises(ValidationError, match="policy"):
        define("odd", [Step("a")], policy="later", register=False)  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        define("none", [], register=False)
    with pytest.raises(ValidationError, match="param"):
        define("tpl", [Step("a", ["zone:{zone}"])], register=False).resolve({})


def test_define_registers_by_name_and_fills_lock_templates() -> None:
    definition = define("registered-for-test", [Step("a", ["pallet:{pallet}"]), Step("b", ["zone:{z}"])])
    assert registry()["registered-for-test"] is definition
    assert definition.resolve({"pallet": 42, "z": "B1"}) == [
        {"name": "a", "locks": ["pallet:42"]},
        {"name": "b", "locks": ["zone:B1"]},
    ]


def test_keys_are_deterministic_and_never_longer_than_the_server_takes() -> None:
    assert _key("s1", "pick", "1", "acquire", "pallet:42") == "saga:s1:pick:1:acquire:pallet:42"
    long = _key("s" * 100, "p" * 100, "1", "acquire", "r" * 200)
    assert len(long) <= 255
    assert long == _key("s" * 100, "p" * 100, "1", "acquire", "r" * 200)
    assert long != _key("s" * 100, "p" * 100, "2", "acquire", "r" * 200)


# --- against the server --------------------------------------------------------------------------------


class Calls:
    """What the actions and compensations were called with, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, Any]] = []

    def action(self, name: str, fail: bool = False) -> Any:
        async def act(ctx: StepContext) -> dict[str, Any]:
            self.log.append(("action", name, sorted(ctx.leases)))
            if fail:
                raise RuntimeError(f"{name} broke")
            return {"step": name, "token": ctx.fencing_token(sorted(ctx.leases)[-1])}

        return act

    def compensation(self, name: str) -> Any:
        async def undo(result: dict[str, Any] | None) -> None:
            self.log.append(("compensate", name, result))

        return undo


def _three_steps(calls: Calls, prefix: str, fail_at: str | None = None) -> SagaDefinition:
    steps = [
        Step(name, [f"{prefix}{name}"], calls.action(name, name == fail_at), calls.compensation(name),
             timeout=10.0, keep=name == "a")
        for name in ("a", "b", "c")
    ]  # fmt: skip
    return define(f"test-{prefix}", steps, register=False)


async def _run(
    client: AsyncClient, saga_id: str, definition: SagaDefinition, saga: AsyncSaga | None = None
) -> list[Any]:
    """Every step of the definition in order, in one saga (``saga`` if given); the results."""
    async with saga or client.saga(saga_id, definition) as running:
        return [await running.step(step.name) for step in definition.steps]


async def _held(client: AsyncClient, prefix: str) -> list[str]:
    return [lock.resource async for lock in client.iter_locks(prefix=prefix)]


async def _acquired(client: AsyncClient, resource: str) -> list[dict[str, Any]]:
    events = (await client.history(resource)).events
    return [e.metadata for e in events if e.type == "LOCK_ACQUIRED"]


@pytest.mark.storage
async def test_a_saga_runs_its_steps_under_their_locks_and_completes(
    server: ServerProcess, unique_prefix: str
) -> None:
    calls = Calls()
    saga_id = f"{unique_prefix}ok"
    async with AsyncClient(server.base_url) as client:
        async with client.saga(saga_id, _three_steps(calls, unique_prefix)) as saga:
            a = await saga.step("a")
            assert await _held(client, unique_prefix) == [f"{unique_prefix}a"]
            await saga.step("b", lock=f"{unique_prefix}b")
            # a is kept for the later steps; b was released when it completed
            assert await _held(client, unique_prefix) == [f"{unique_prefix}a"]
            await saga.step("c")
        assert a is not None
        assert a["step"] == "a"
        assert [entry[:2] for entry in calls.log] == [("action", "a"), ("action", "b"), ("action", "c")]
        assert calls.log[1][2] == [f"{unique_prefix}a", f"{unique_prefix}b"]  # b runs with a still held
        view = await get_saga(client, saga_id)
        assert view.status == "completed"
        assert [s.status for s in view.steps] == ["completed"] * 3
        assert view.step("a").result == a
        assert await _held(client, unique_prefix) == []
        [meta] = await _acquired(client, f"{unique_prefix}b")
        assert meta["saga_id"] == saga_id
        assert meta["saga_step"] == "b"
        assert meta["idempotency_key"] == f"saga:{saga_id}:b:1:acquire:{unique_prefix}b"
        assert [e.type for e in view.timeline][-1] == "SAGA_COMPLETED"


@pytest.mark.storage
async def test_a_failing_action_compensates_the_completed_steps_in_reverse_once_each(
    server: ServerProcess, unique_prefix: str
) -> None:
    calls = Calls()
    saga_id = f"{unique_prefix}fails"
    async with AsyncClient(server.base_url) as client:
        with pytest.raises(SagaFailed) as failed:
            await _run(client, saga_id, _three_steps(calls, unique_prefix, fail_at="c"))
        assert failed.value.step == "c"
        results = [(await get_saga(client, saga_id)).step(name).result for name in ("a", "b")]
        assert isinstance(failed.value.__cause__, RuntimeError)
        compensations = [(name, result) for kind, name, result in calls.log if kind == "compensate"]
        assert compensations == [("b", results[1]), ("a", results[0])]
        view = await get_saga(client, saga_id)
        assert view.status == "aborted"
        assert [s.status for s in view.steps] == ["compensated", "compensated", "failed"]
        assert view.step("c").error == "RuntimeError: c broke"
        assert await _held(client, unique_prefix) == []
        types = [e.type for e in view.timeline]
        assert types.index("STEP_FAILED") < types.index("COMPENSATION_STARTED")
        assert types[-1] == "SAGA_ABORTED"


@pytest.mark.storage
async def test_a_step_timing_out_on_a_held_lock_fails_and_compensates(
    server: ServerProcess, unique_prefix: str
) -> None:
    calls = Calls()
    definition = define(
        f"timeout-{unique_prefix}",
        [Step("a", [f"{unique_prefix}a"], calls.action("a"), calls.compensation("a"), keep=True),
         Step("b", [f"{unique_prefix}b"], calls.action("b"), calls.compensation("b"), timeout=1.0)],
        register=False,
    )  # fmt: skip
    async with (
        AsyncClient(server.base_url) as client,
        AsyncClient(server.base_url) as other,
        other.lock(f"{unique_prefix}b", ttl=30),
    ):
        with pytest.raises(SagaFailed) as failed:
            await _run(client, f"{unique_prefix}t", definition)
        assert failed.value.reason == "timeout"
        assert isinstance(failed.value.__cause__, TimeoutError)
        assert [entry[:2] for entry in calls.log] == [("action", "a"), ("compensate", "a")]
        assert await _held(client, unique_prefix) == [f"{unique_prefix}b"]  # only the other agent's


class DropFirstAcquireAnswer(httpx.AsyncBaseTransport):
    """Sends every request; the first acquire's answer is lost on the way back (the lock was taken)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.acquires: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/acquire"):
            self.acquires.append(request)
            if len(self.acquires) == 1:
                await response.aread()
                raise httpx.ReadError("connection reset after the request was processed", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.storage
async def test_a_step_retried_after_a_dropped_answer_takes_no_second_lock(
    server: ServerProcess, unique_prefix: str
) -> None:
    calls = Calls()
    transport = DropFirstAcquireAnswer()
    saga_id = f"{unique_prefix}drop"
    async with AsyncClient(server.base_url, transport=transport) as client:
        async with client.saga(saga_id, _three_steps(calls, unique_prefix)) as saga:
            await saga.step("a")
            await saga.step("b")
            await saga.step("c")
        first, retry = transport.acquires[:2]
        assert first.headers["Idempotency-Key"] == retry.headers["Idempotency-Key"]
        assert retry.headers["X-Saga-ID"] == saga_id
        assert retry.headers["X-Saga-Step"] == "a"
        assert len(await _acquired(client, f"{unique_prefix}a")) == 1
        assert (await get_saga(client, saga_id)).status == "completed"


@pytest.mark.storage
async def test_a_resumed_saga_takes_back_its_kept_lease_instead_of_a_second_lock(
    server: ServerProcess, unique_prefix: str
) -> None:
    """The first orchestrator stops after step a (its lease on a kept, live); a second one with the same
    agent id recovers the saga forward: a's acquire replays, the lease is renewed, not taken again."""
    calls = Calls()
    steps = _three_steps(calls, unique_prefix).steps
    definition = define(f"resume-{unique_prefix}", steps, policy="forward", register=False)
    saga_id = f"{unique_prefix}resume"
    async with AsyncClient(server.base_url, agent_id=f"{unique_prefix}agv") as first:
        saga = first.saga(saga_id, definition)
        await saga.__aenter__()
        await saga.step("a")
        token = saga.leases[f"{unique_prefix}a"].fencing_token
        for lease in saga.leases.values():  # the first orchestrator dies: no more heartbeats
            for task in lease._tasks:
                task.cancel()
        async with AsyncClient(server.base_url, agent_id=f"{unique_prefix}agv") as second:
            [view] = await second.recover_sagas([definition])
            assert view.status == "completed"
            acquired = await _acquired(second, f"{unique_prefix}a")
            assert len(acquired) == 1
            history = (await second.history(f"{unique_prefix}a")).events
            renewals = [e for e in history if e.type == "LOCK_RENEWED"]
            assert renewals
            assert all(int(e.data.get("fencing_token", token)) == token for e in renewals)
            assert await _held(second, unique_prefix) == []
    assert [entry[:2] for entry in calls.log] == [("action", "a"), ("action", "b"), ("action", "c")]


@pytest.mark.storage
def test_the_blocking_twin_runs_plain_functions(server: ServerProcess, unique_prefix: str) -> None:
    log: list[str] = []

    def act(ctx: StepContext) -> dict[str, Any]:
        log.append(f"{ctx.step}:{ctx.fencing_token(next(iter(ctx.leases)))}")
        return {"done": ctx.step}

    definition = define(
        f"sync-{unique_prefix}",
        [Step("a", [f"{unique_prefix}a"], act, keep=True), Step("b", [f"{unique_prefix}b"], act)],
        register=False,
    )
    with Client(server.base_url) as client:
        with client.saga(f"{unique_prefix}sync", definition) as saga:
            assert saga.step("a") == {"done": "a"}
            saga.step("b")
        assert saga.view is not None
        assert saga.view.status == "completed"
        assert [lock.resource for lock in client.iter_locks(prefix=unique_prefix)] == []
    assert [entry.split(":")[0] for entry in log] == ["a", "b"]


class Recording(httpx.HTTPTransport):
    """A blocking transport that remembers the path of every request it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return super().handle_request(request)


@pytest.mark.storage
def test_a_blocking_saga_and_its_recovery_go_through_the_clients_own_transport(
    server: ServerProcess, unique_prefix: str
) -> None:
    """The blocking saga is the asyncio one over the blocking client's public ``request``: its starts,
    steps, leases and recovery all pass through the client's transport (and so its pool and breaker)."""
    definition = define(
        f"sync-transport-{unique_prefix}",
        [Step("a", [f"{unique_prefix}a"], lambda ctx: None)],
        register=False,
    )
    transport = Recording()
    with Client(server.base_url, transport=transport, agent_id=f"{unique_prefix}agv") as client:
        with pytest.raises(RuntimeError, match="cut short"), client.saga(f"{unique_prefix}t", definition):
            raise RuntimeError("cut short")
        assert client.recover_sagas([definition]) == []  # aborted and compensated already: nothing left
    assert transport.paths.count("/v1/sagas") == 3  # the start, then recovery's running and compensating
    assert f"/v1/sagas/{unique_prefix}t/abort" in transport.paths


@pytest.mark.storage
async def test_an_exception_between_steps_aborts_and_compensates(
    server: ServerProcess, unique_prefix: str
) -> None:
    calls = Calls()
    async with AsyncClient(server.base_url) as client:

        async def change_of_mind() -> None:
            async with client.saga(f"{unique_prefix}x", _three_steps(calls, unique_prefix)) as saga:
                await saga.step("a")
                raise KeyError("the operator changed their mind")

        with pytest.raises(KeyError):
            await change_of_mind()
        view = await get_saga(client, f"{unique_prefix}x")
        assert view.status == "aborted"
        assert [s.status for s in view.steps] == ["compensated", "pending", "pending"]
        assert await _held(client, unique_prefix) == []


def _flaky(calls: list[Any], failures: int) -> Any:
    """A compensation that fails its first ``failures`` calls."""

    async def undo(result: dict[str, Any] | None) -> None:
        calls.append(result)
        if len(calls) <= failures:
            raise OSError(f"gripper jammed ({len(calls)})")

    return undo


def _failing_second_step(prefix: str, undo: Any) -> SagaDefinition:
    async def ok(ctx: StepContext) -> dict[str, Any]:
        return {"at": ctx.step}

    async def broken(ctx: StepContext) -> None:
        raise RuntimeError("no")

    steps = [Step("a", [f"{prefix}a"], ok, undo, keep=True), Step("b", [f"{prefix}b"], broken)]
    return define(f"flaky-{prefix}", steps, register=False)


@pytest.mark.storage
async def test_a_failed_compensation_is_retried_with_the_same_result(
    server: ServerProcess, unique_prefix: str
) -> None:
    calls: list[Any] = []
    async with AsyncClient(server.base_url) as client:
        with pytest.raises(SagaFailed):
            await _run(client, f"{unique_prefix}f", _failing_second_step(unique_prefix, _flaky(calls, 2)))
        view = await get_saga(client, f"{unique_prefix}f")
        assert calls == [{"at": "a"}] * 3
        assert view.status == "aborted"
        assert view.step("a").compensation_failures == 2
        assert [e.type for e in view.timeline].count("COMPENSATION_FAILED") == 2
        assert await _held(client, unique_prefix) == []


@pytest.mark.storage
@pytest.mark.slow
async def test_a_compensation_failing_five_times_leaves_the_saga_stuck_and_its_locks_free(
    server: ServerProcess, unique_prefix: str
) -> None:
    calls: list[Any] = []
    async with AsyncClient(server.base_url) as client:
        with pytest.raises(SagaStuck) as stuck:
            await _run(client, f"{unique_prefix}s", _failing_second_step(unique_prefix, _flaky(calls, 99)))
        assert len(calls) == 5
        assert stuck.value.step == "a"
        view = await get_saga(client, f"{unique_prefix}s")
        assert view.status == "stuck"
        assert view.reason == "OSError: gripper jammed (5)"
        assert await _held(client, unique_prefix) == []


@pytest.mark.storage
async def test_with_a_token_the_saga_is_the_agents_and_recovery_finds_it(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    """With authentication the owner is the token's principal: the SDK names no owner, and a second
    orchestrator with the same token compensates the saga the first left half-done and frees its lock."""
    calls = Calls()
    name = f"{unique_prefix}agv".replace(":", "-")
    token = await issue_token(name, Role.AGENT)
    definition = _three_steps(calls, unique_prefix)
    saga_id = f"{unique_prefix}auth"
    async with AsyncClient(auth_server.base_url, token=token) as first:
        saga = first.saga(saga_id, definition)
        await saga.__aenter__()
        result = await saga.step("a")
        assert saga.view is not None
        assert saga.view.owner == name
        for lease in saga.leases.values():  # the first orchestrator dies
            for task in lease._tasks:
                task.cancel()
        async with AsyncClient(auth_server.base_url, token=token) as second:
            [view] = await second.recover_sagas([definition])
            assert view.status == "aborted"
    investigator = await issue_token(f"{name}-inv", Role.INVESTIGATOR)
    async with AsyncClient(auth_server.base_url, token=investigator) as reader:
        assert await _held(reader, unique_prefix) == []  # an agent may not list locks: an investigator may
        assert len(await _acquired(reader, f"{unique_prefix}a")) == 1  # taken back, not taken again
    assert calls.log[-1] == ("compensate", "a", result)


@pytest.mark.storage
async def test_with_a_token_recovery_frees_the_lock_of_a_step_cut_short(
    auth_server: ServerProcess, issue_token: IssueToken, unique_prefix: str
) -> None:
    """The orchestrator dies inside step b's action, b's lease live. An agent may not list locks, so the
    recovering orchestrator finds that lease through b's Idempotency-Key: replayed, renewed, released."""
    calls = Calls()
    entered = asyncio.Event()

    async def hangs(ctx: StepContext) -> None:
        entered.set()
        await asyncio.Event().wait()

    steps = list(_three_steps(calls, unique_prefix).steps)
    steps[1] = Step("b", [f"{unique_prefix}b"], hangs, calls.compensation("b"), timeout=30.0)
    definition = define(f"cut-{unique_prefix}", steps, register=False)
    name = f"{unique_prefix}agv".replace(":", "-")
    token = await issue_token(name, Role.AGENT)
    async with AsyncClient(auth_server.base_url, token=token) as first:
        saga = first.saga(f"{unique_prefix}cut", definition)
        await saga.__aenter__()
        await saga.step("a")
        running = asyncio.create_task(saga.step("b"))
        await entered.wait()
        for lease in saga.leases.values():  # the orchestrator dies mid-step: nothing more is sent
            for task in lease._tasks:
                task.cancel()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    async with AsyncClient(auth_server.base_url, token=token) as second:
        [view] = await second.recover_sagas([definition])
    assert view.status == "aborted"
    assert [s.status for s in view.steps] == ["compensated", "failed", "pending"]
    investigator = await issue_token(f"{name}-inv", Role.INVESTIGATOR)
    async with AsyncClient(auth_server.base_url, token=investigator) as reader:
        assert await _held(reader, unique_prefix) == []
        assert len(await _acquired(reader, f"{unique_prefix}b")) == 1
    assert [entry[:2] for entry in calls.log] == [("action", "a"), ("compensate", "a")]


# --- the saga's own lease ------------------------------------------------------------------------------


def test_a_saga_lease_is_seconds_above_zero() -> None:
    definition = define("leased", [Step("a")], register=False)
    with pytest.raises(ValidationError, match="lease"):
        AsyncClient("http://127.0.0.1:9").saga("s", definition, lease=0)


@pytest.mark.storage
async def test_heartbeats_keep_a_saga_alive_through_a_step_longer_than_its_lease(
    server: ServerProcess, unique_prefix: str
) -> None:
    """The server's reaper lapses a saga lease within its 100 ms pass: only the heartbeats (every third of
    the 1 s lease) keep this saga, whose step lasts 2.5 leases, running to completion."""

    async def slow(ctx: StepContext) -> dict[str, Any]:
        await asyncio.sleep(2.5)
        return {"slow": True}

    definition = define(f"long-{unique_prefix}", [Step("a", [f"{unique_prefix}a"], slow)], register=False)
    saga_id = f"{unique_prefix}long"
    async with AsyncClient(server.base_url) as client:
        async with client.saga(saga_id, definition, lease=1.0) as saga:
            await saga.step("a")
        view = await get_saga(client, saga_id)
    assert view.status == "completed"
    assert view.lease_ms == 1000
    assert view.lease_expires_at is None  # ended: no deadline left
    types = [e.type for e in view.timeline]
    assert "SAGA_LEASE_RENEWED" in types
    assert "SAGA_LEASE_EXPIRED" not in types


@pytest.mark.storage
def test_the_blocking_twin_heartbeats_too(server: ServerProcess, unique_prefix: str) -> None:
    def slow(ctx: StepContext) -> None:
        time.sleep(2.5)

    definition = define(f"long-sync-{unique_prefix}", [Step("a", [], slow)], register=False)
    with (
        Client(server.base_url) as client,
        client.saga(f"{unique_prefix}long-sync", definition, lease=1.0) as saga,
    ):
        saga.step("a")
    assert saga.view is not None
    assert saga.view.status == "completed"


@pytest.mark.storage
async def test_a_saga_whose_orchestrator_vanished_is_compensated_by_the_server(
    server: ServerProcess, unique_prefix: str
) -> None:
    """The orchestrator stops mid-step without a word (its task is gone, heartbeats with it): the
    server's reaper fails the step and the saga goes to compensation, with the lapse recorded."""
    calls = Calls()
    definition = _three_steps(calls, unique_prefix)
    saga_id = f"{unique_prefix}vanished"
    async with AsyncClient(server.base_url) as client:
        saga = client.saga(saga_id, definition, lease=1.0)
        await saga.__aenter__()
        await saga.step("a")
        await saga._post("/steps/b/start")
        await saga._stop_beating()  # the orchestrator is gone: no heartbeat, no further call
        for _ in range(100):
            view = await get_saga(client, saga_id)
            if view.status != "running":
                break
            await asyncio.sleep(0.1)
        assert view.status == "compensating"
        assert view.step("b").status == "failed"
        assert view.lease_lapsed_at is not None
        metrics = (await client._http.get("/metrics")).text
        assert 'lockledger_saga_lapses_total{status="compensating"}' in metrics
        # A new orchestrator recovers it: it compensates step a, and the saga is aborted.
        [recovered] = await client.recover_sagas([definition])
        await saga._release()
    assert recovered.status == "aborted"
    assert [entry[:2] for entry in calls.log] == [("action", "a"), ("compensate", "a")]


@pytest.mark.storage
@pytest.mark.parametrize("then", ["returns", "raises"])
async def test_an_orchestrator_cut_off_past_its_lease_compensates_what_the_server_lapsed(
    server: ServerProcess, unique_prefix: str, then: str
) -> None:
    """Step b's action outlives the saga's lease with no heartbeat (as when the service was down): the
    server fails b and the saga compensates. The orchestrator, still here, finds b's outcome refused and
    compensates step a itself, whether b's action then returns or raises."""
    calls = Calls()
    saga_id = f"{unique_prefix}cut-{then}"
    async with AsyncClient(server.base_url) as client:

        async def cut_off(ctx: StepContext) -> None:
            await saga._stop_beating()
            for _ in range(100):
                if (await get_saga(client, saga_id)).status == "compensating":
                    break
                await asyncio.sleep(0.1)
            if then == "raises":
                raise RuntimeError("b gave up")

        definition = define(
            f"cut-{unique_prefix}{then}",
            [
                Step("a", [f"{unique_prefix}{then}a"], calls.action("a"), calls.compensation("a"), keep=True),
                Step("b", [f"{unique_prefix}{then}b"], cut_off),
            ],
            register=False,
        )
        saga = client.saga(saga_id, definition, lease=1.0)
        with pytest.raises((SagaFailed, LockLedgerError)):
            await _run(client, saga_id, definition, saga)
        view = await get_saga(client, saga_id)
        assert await _held(client, unique_prefix) == []
    assert view.status == "aborted"
    assert view.step("b").error == "saga lease lapsed: the orchestrator stopped heartbeating"
    assert [entry[:2] for entry in calls.log] == [("action", "a"), ("compensate", "a")]


@pytest.mark.storage
async def test_recovery_leaves_a_saga_of_an_unknown_definition_alone(
    server: ServerProcess, unique_prefix: str
) -> None:
    """Logged and skipped: the log record's fields must not clash with the record's own (``name``)."""
    definition = define(f"unknown-{unique_prefix}", [Step("a", [f"{unique_prefix}a"])], register=False)
    async with AsyncClient(server.base_url, agent_id=f"{unique_prefix}agv") as client:
        saga = client.saga(f"{unique_prefix}unknown", definition)
        await saga.__aenter__()
        await saga._stop_beating()
        assert await client.recover_sagas([]) == []
        assert (await get_saga(client, f"{unique_prefix}unknown")).status == "running"
