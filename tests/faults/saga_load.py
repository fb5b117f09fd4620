"""Saga traffic for the fault scenarios: several orchestrators run short pallet -> zone sagas at once.

Each orchestrator is an asyncio task with its own SDK client (its own agent id, retries and breaker). It
runs sagas of three steps one after another: ``pick`` (its own pallet, kept), ``drive`` (one of a few
shared zones; one zone is occupied by another agent for the whole scenario, so a drive there times out)
and ``drop`` (a shared dock). The saga's id says what it is meant to do: ``ok``, ``fail-drive`` or
``fail-drop`` (that step's action raises on purpose) or ``occupied`` (its zone is the occupied one). The
plan is in the id, not in ``params``, so a recovering orchestrator, which knows only the server's log,
runs the same actions.

An orchestrator that meets an error other than ``SagaFailed`` (the service was killed, the database went
away) leaves the saga to recovery: before its next saga it calls ``recover_sagas`` for its own agent until
that succeeds. When the scenario stops them, every orchestrator calls ``recover_sagas`` once more.

Every action and compensation is recorded in :class:`World`, a dict keyed by ``(saga, step)``: the
effect a step's action applied, whether a compensation undid it, and every call, in order. Compensations
are idempotent as the SDK asks (they check the world first), so a compensation called again after a
fault shows up as a call that changed nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import asyncpg

import lockledger
from eventstore.dburl import asyncpg_dsn
from eventstore.verify import event_hash
from lockledger import BreakerConfig, CircuitBreaker, NotFound
from lockledger.saga import (
    Policy,
    SagaDefinition,
    SagaFailed,
    SagaStuck,
    SagaView,
    Step,
    StepContext,
    define,
    get_saga,
)

STEPS = ("pick", "drive", "drop")
PLANS = ("ok", "ok", "fail-drive", "fail-drop", "occupied")
ZONES = 3  # zone0 .. zone2 take turns; the occupied zone is extra
DOCKS = 2

Kind = Literal["action", "compensate"]


@dataclass(frozen=True)
class Call:
    """One call of an action or a compensation."""

    saga: str
    step: str
    kind: Kind
    applied: bool  # it changed the world (an action that raised, or an undo already done, did not)
    result: dict[str, Any] | None  # what the action returned, or what the compensation was given


@dataclass
class World:
    """What the sagas did to the world: per ``(saga, step)``, ``"applied"`` once its action ran and
    ``"undone"`` once a compensation reverted it; ``calls`` in the order they happened."""

    effects: dict[tuple[str, str], str] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def of(self, saga: str) -> list[Call]:
        return [call for call in self.calls if call.saga == saga]

    def action(self, step: str) -> Any:
        async def act(ctx: StepContext) -> dict[str, Any]:
            await asyncio.sleep(0.01)  # a little work, so faults land inside steps too
            if plan_of(ctx.saga_id) == f"fail-{step}":
                self.calls.append(Call(ctx.saga_id, step, "action", False, None))
                raise RuntimeError(f"{step} failed on purpose")
            fresh = (ctx.saga_id, step) not in self.effects
            if fresh:
                self.effects[(ctx.saga_id, step)] = "applied"
            token = ctx.fencing_token(sorted(ctx.leases)[0])
            result = {"saga": ctx.saga_id, "step": step, "nonce": uuid.uuid4().hex[:8], "token": token}
            self.calls.append(Call(ctx.saga_id, step, "action", fresh, result))
            return result

        return act

    def compensation(self, step: str) -> Any:
        async def undo(result: dict[str, Any] | None) -> None:
            assert result is not None
            assert result["step"] == step, result
            saga = str(result["saga"])
            key = (saga, step)
            fresh = self.effects.get(key) == "applied"
            if fresh:
                self.effects[key] = "undone"
            self.calls.append(Call(saga, step, "compensate", fresh, result))
            await asyncio.sleep(0.01)

        return undo


def plan_of(saga_id: str) -> str:
    """``<prefix>o<n>s<m>-<plan>``: the prefix has no dash, the plan may have one."""
    return saga_id.partition("-")[2]


def definition(world: World, prefix: str, policy: Policy) -> SagaDefinition:
    locks = {"pick": "{prefix}pallet{pallet}", "drive": "{prefix}zone{zone}", "drop": "{prefix}dock{dock}"}
    timeouts = {"pick": 4.0, "drive": 1.5, "drop": 4.0}
    steps = [
        Step(name, [locks[name]], world.action(name), world.compensation(name), timeout=timeouts[name],
             keep=name == "pick", ttl=10.0)
        for name in STEPS
    ]  # fmt: skip
    return define(f"fault-pallet-to-zone-{policy}", steps, policy=policy, register=False)


def occupied_zone(prefix: str) -> str:
    return f"{prefix}zone{ZONES}"


@dataclass
class Orchestrator:
    """One orchestrator: runs sagas until stopped, recovering its own after an error."""

    number: int
    base_url: str
    prefix: str
    world: World
    policy: Policy
    patient: bool
    seed: int
    agent: str = ""
    started: list[str] = field(default_factory=list)  # saga ids, in order
    outcomes: dict[str, str] = field(default_factory=dict)  # completed, failed, stuck or error:<kind>
    errors: list[str] = field(default_factory=list)
    recoveries: list[list[SagaView]] = field(default_factory=list)  # what each recover_sagas finished

    def __post_init__(self) -> None:
        self.agent = f"{self.prefix}orch{self.number}"
        self.definition = definition(self.world, self.prefix, self.policy)
        self.rng = random.Random(self.seed * 100 + self.number)
        self._dirty = False

    def client(self) -> lockledger.AsyncClient:
        # A breaker that opens for half a second only: the scenario's outages are short, and an
        # orchestrator must not be locked out for the default 30 s once the service is back.
        # A patient orchestrator's retries outlast a restart; an impatient one gives up within half a
        # second and leaves the saga to recover_sagas.
        attempts, retry_timeout = (6, 6.0) if self.patient else (2, 0.5)
        breaker = CircuitBreaker(BreakerConfig(wait_duration_in_open=0.5), name=self.agent)
        return lockledger.AsyncClient(
            self.base_url, agent_id=self.agent, timeout=5.0, retry_attempts=attempts,
            retry_timeout=retry_timeout, breaker=breaker,
        )  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        async with self.client() as client:
            while not stop.is_set():
                if self._dirty and not await self.recover(client):
                    await asyncio.sleep(0.3)
                    continue
                await self.run_one(client)
                await asyncio.sleep(self.rng.uniform(0, 0.05))

    async def run_one(self, client: lockledger.AsyncClient) -> None:
        plan = self.rng.choice(PLANS)
        saga_id = f"{self.prefix}o{self.number}s{len(self.started)}-{plan}"
        zone = ZONES if plan == "occupied" else self.rng.randrange(ZONES)
        params = {
            "prefix": self.prefix,
            "pallet": self.number,
            "zone": zone,
            "dock": self.rng.randrange(DOCKS),
        }
        self.started.append(saga_id)
        try:
            async with client.saga(saga_id, self.definition, params=params) as saga:
                for step in STEPS:
                    await saga.step(step)
            self.outcomes[saga_id] = "completed"
        except SagaStuck:
            self.outcomes[saga_id] = "stuck"
        except SagaFailed:
            self.outcomes[saga_id] = "failed"
        except Exception as error:  # the fault: the saga is left to recover_sagas
            self.outcomes[saga_id] = f"error:{type(error).__name__}"
            self.errors.append(f"{saga_id}: {type(error).__name__}: {error}"[:300])
            self._dirty = True

    async def recover(self, client: lockledger.AsyncClient) -> bool:
        """``recover_sagas`` for this agent; False if the service did not answer."""
        try:
            views = await client.recover_sagas([self.definition])
        except Exception as error:
            self.errors.append(f"recover_sagas: {type(error).__name__}: {error}"[:300])
            return False
        self.recoveries.append(views)
        self._dirty = False
        return True

    async def final_recovery(self, attempts: int = 40) -> None:
        """Once the server is back for good: ``recover_sagas`` until it answers (a fresh client, so no
        breaker state is carried over)."""
        async with self.client() as client:
            for _ in range(attempts):
                if await self.recover(client):
                    return
                await asyncio.sleep(0.25)
        raise AssertionError(f"{self.agent}: recover_sagas never succeeded: {self.errors[-3:]}")


class SagaLoad:
    """``async with SagaLoad(...) as load:`` runs the orchestrators (and the agent occupying a zone);
    leaving the block stops them, lets each finish its saga in hand, then runs their final recovery."""

    def __init__(self, base_url: str, prefix: str, orchestrators: int = 6, seed: int = 0) -> None:
        self.base_url = base_url
        self.prefix = prefix
        self.world = World()
        # Both policies, each with patient and impatient clients.
        policies: tuple[Policy, ...] = ("compensate", "forward")
        self.orchestrators = [
            Orchestrator(n, base_url, prefix, self.world, policies[n % 2], (n // 2) % 2 == 0, seed)
            for n in range(orchestrators)
        ]
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._occupant: lockledger.AsyncClient | None = None
        self._occupied_token: int | None = None
        self._occupant_id = f"{prefix}occupant"

    async def __aenter__(self) -> SagaLoad:
        self._occupant = lockledger.AsyncClient(self.base_url)
        lease = await self._occupant.acquire(occupied_zone(self.prefix), self._occupant_id, ttl=60.0)
        self._occupied_token = lease.fencing_token
        self._tasks = [
            asyncio.create_task(o.run(self._stop), name=f"orchestrator-{o.number}")
            for o in self.orchestrators
        ]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stop.set()
        try:
            # Every saga step is bounded by its timeout and the SDK's retries by theirs.
            done, pending = await asyncio.wait(self._tasks, timeout=40.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for task in done:
                if task.exception() is not None:
                    raise RuntimeError(f"{task.get_name()} failed") from task.exception()
            assert not pending, "an orchestrator did not stop"
            await asyncio.gather(*(o.final_recovery() for o in self.orchestrators))
        finally:
            await self._release_occupied_zone()

    async def _release_occupied_zone(self) -> None:
        assert self._occupant is not None
        try:
            if self._occupied_token is not None:
                with contextlib.suppress(lockledger.LockLedgerError):
                    await self._occupant.release(
                        occupied_zone(self.prefix), self._occupant_id, self._occupied_token
                    )
        finally:
            await self._occupant.aclose()

    @property
    def saga_ids(self) -> list[str]:
        return [saga for o in self.orchestrators for saga in o.started]

    @property
    def errors(self) -> list[str]:
        return [error for o in self.orchestrators for error in o.errors]

    def outcome(self, saga_id: str) -> str:
        return next(o.outcomes.get(saga_id, "unknown") for o in self.orchestrators if saga_id in o.started)

    def policy(self, saga_id: str) -> Policy:
        return next(o.policy for o in self.orchestrators if saga_id in o.started)

    @property
    def recovered(self) -> list[SagaView]:
        """Every saga a ``recover_sagas`` call finished (during the run and at the end)."""
        return [view for o in self.orchestrators for views in o.recoveries for view in views]


# --- the checks ------------------------------------------------------------------------------------------

CHAIN_SQL = """
SELECT stream_id, stream_version, event_id::text AS event_id, event_type, data::text AS data,
       metadata::text AS metadata, recorded_at, hash
  FROM events
 WHERE starts_with(stream_id, $1::text) OR starts_with(stream_id, $2::text)
 ORDER BY stream_id, stream_version
"""


@dataclass
class SagaAudit:
    views: dict[str, SagaView]
    violations: list[str]
    streams_verified: int
    held: list[str]

    def count(self, status: str) -> int:
        return sum(view.status == status for view in self.views.values())

    @property
    def compensated_steps(self) -> int:
        return sum(s.status == "compensated" for view in self.views.values() for s in view.steps)

    def summary(self, load: SagaLoad) -> dict[str, Any]:
        return {
            "sagas": len(self.views), "completed": self.count("completed"), "aborted": self.count("aborted"),
            "compensated_steps": self.compensated_steps,
            "orchestrator_errors": sum(o.outcomes[s].startswith("error") for o in load.orchestrators
                                       for s in o.started if s in o.outcomes),
            "recovered_by_recover_sagas": len(load.recovered),
            "compensations_called_again": sum(not c.applied for c in load.world.calls
                                              if c.kind == "compensate"),
            "streams_verified": self.streams_verified, "violations": len(self.violations),
        }  # fmt: skip


def check_saga(view: SagaView, load: SagaLoad) -> list[str]:
    """Every invariant of one finished saga: its final status, its timeline, and what its actions and
    compensations did to the world."""
    saga = view.saga_id
    found: list[str] = []

    def flag(what: str) -> None:
        found.append(f"{saga}: {what}")

    types = [(e.type, e.data.get("step")) for e in view.timeline]
    if view.status not in ("completed", "aborted"):
        flag(f"ended {view.status} ({view.reason})")
    outcome, plan = load.outcome(saga), plan_of(saga)
    if outcome == "completed" and view.status != "completed":
        flag(f"the orchestrator saw it complete, the server says {view.status}")
    if outcome == "failed" and view.status != "aborted":
        flag(f"the orchestrator saw SagaFailed, the server says {view.status}")
    if plan != "ok" and view.status == "completed":
        flag(f"planned to fail ({plan}) yet completed")

    # No step started once the saga had failed or been asked to abort.
    stops = ("STEP_FAILED", "SAGA_ABORT_REQUESTED")
    stopped = next((i for i, (t, _) in enumerate(types) if t in stops), None)
    if stopped is not None and any(t == "STEP_STARTED" for t, _ in types[stopped:]):
        flag(f"STEP_STARTED after {types[stopped][0]}: {types}")

    completed = [step for t, step in types if t == "STEP_COMPLETED"]
    compensated = [step for t, step in types if t == "COMPENSATION_COMPLETED"]
    statuses = {s.name: s.status for s in view.steps}
    if len(set(completed)) != len(completed):
        flag(f"a step completed twice: {completed}")
    if view.status == "completed":
        if completed != list(STEPS) or set(statuses.values()) != {"completed"}:
            flag(f"completed with steps {statuses}, completions {completed}")
        if compensated or any(t.startswith("COMPENSATION") for t, _ in types):
            flag(f"completed, yet compensations ran: {types}")
    if view.status == "aborted":
        # Every completed step compensated exactly once, last completed first.
        if compensated != list(reversed(completed)):
            flag(f"compensations {compensated} are not the completed steps {completed} in reverse")
        if not set(statuses.values()) <= {"compensated", "failed", "pending"}:
            flag(f"aborted with steps {statuses}")
        if types[-1][0] != "SAGA_ABORTED":
            flag(f"aborted, but the timeline ends with {types[-1]}")

    # The world: what the actions and compensations did.
    calls = load.world.of(saga)
    first_undo = next((i for i, c in enumerate(calls) if c.kind == "compensate"), None)
    if first_undo is not None and any(c.kind == "action" for c in calls[first_undo:]):
        flag(f"an action ran after compensation began: {calls}")
    for step in STEPS:
        undos = [c for c in calls if (c.step, c.kind) == (step, "compensate")]
        applied_undos = sum(c.applied for c in undos)
        applied_actions = sum(c.applied for c in calls if (c.step, c.kind) == (step, "action"))
        if applied_undos > 1:
            flag(f"{step}: its effect was compensated {applied_undos} times")
        if applied_actions > 1:
            flag(f"{step}: its action applied its effect {applied_actions} times")
        if statuses[step] == "compensated" and applied_undos != 1:
            flag(f"{step}: compensated on the server, {applied_undos} undo applied: {undos}")
        if statuses[step] != "compensated" and undos:
            flag(f"{step}: is {statuses[step]}, yet its compensation was called: {undos}")
        recorded = view.step(step).result
        if any(c.result != recorded for c in undos):
            flag(f"{step}: a compensation was not given the recorded result {recorded}: {undos}")
        effect = load.world.effects.get((saga, step))
        if statuses[step] == "completed" and effect != "applied":
            flag(f"{step}: completed, but its effect is {effect}")
        if statuses[step] == "compensated" and effect != "undone":
            flag(f"{step}: compensated, but its effect is {effect}")
    return found


async def audit_sagas(load: SagaLoad, database_url: str) -> SagaAudit:
    """Read every saga the orchestrators started (and every saga of their agents) from the server,
    check each, check that no lock under the prefix is held, and verify the hash chain of every saga and
    lock stream of the scenario."""
    violations: list[str] = []
    views: dict[str, SagaView] = {}
    async with lockledger.AsyncClient(load.base_url) as client:
        for saga in load.saga_ids:
            try:
                views[saga] = await get_saga(client, saga)
            except NotFound:
                if not load.outcome(saga).startswith("error"):
                    violations.append(f"{saga}: never recorded, yet the orchestrator saw it run")
        for o in load.orchestrators:
            for status in ("running", "compensating", "stuck"):
                page = await client.request("GET", "/v1/sagas", params={"owner": o.agent, "status": status})
                left = [item["saga_id"] for item in page.data["items"]]
                if left:
                    violations.append(f"{o.agent}: sagas left {status}: {left}")
        page = await client.request("GET", "/v1/locks", params={"prefix": load.prefix, "limit": 1000})
        leases = page.data["items"]
    held = [lease["resource"] for lease in leases]
    for lease in leases:
        tagged = {k: lease.get(k) for k in ("owner", "fencing_token", "saga_id", "saga_step", "expires_at")}
        violations.append(f"{lease['resource']} is still held: {tagged}")
    for view in views.values():
        violations += check_saga(view, load)

    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        rows = await conn.fetch(CHAIN_SQL, f"saga/{load.prefix}", load.prefix)
    finally:
        await conn.close()
    previous, stream, version, streams = b"", None, 0, set()
    for row in rows:
        if row["stream_id"] != stream:
            stream, previous, version = row["stream_id"], b"", 0
            streams.add(stream)
        version += 1
        if row["stream_version"] != version:
            violations.append(f"{stream}: version {version} is missing")
        digest = event_hash(
            previous, row["stream_id"], row["stream_version"], row["event_id"], row["event_type"],
            row["data"], row["metadata"], row["recorded_at"],
        )  # fmt: skip
        if digest != bytes(row["hash"]):
            violations.append(f"{stream}: v{row['stream_version']}: the hash does not match the event")
        previous = digest
    unverified = {f"saga/{saga}" for saga in views} - streams
    if unverified:
        violations.append(f"saga streams missing from the log: {sorted(unverified)}")
    return SagaAudit(views, violations, len(streams), held)
