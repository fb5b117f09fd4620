"""A fleet simulator: N simulated AGVs move pallets into zones against a running lockledger service, through
the SDK alone, with contention, crashes and lost responses, checking the lock invariants as they go.

Each AGV loops until the time is up. Mostly it runs a pallet-to-zone saga: step ``pick`` locks
``{prefix}pallet:{n}`` and keeps it, step ``drive`` locks ``{prefix}zone:{z}``; a failed drive puts the
pallet back (the pick's compensation). Sometimes it parks in a zone instead, holding the zone's lease
(with heartbeats) for a while, so drives wait and time out. Few pallets and zones for many agents make
them contend. With ``crash_probability`` a unit of work is cut short by a crash: the agent's network goes
dead (``faults``), so its heartbeats stop and its leases are left to the reaper; it comes back
after a pause as a new incarnation and recovers the saga it was running (its id, as a robot would keep
its current job on disk) from the server's log. With ``drop_probability`` a command's answer is lost after
the server processed it, and the SDK's retry gets the stored answer under the same Idempotency-Key.

With ``route_probability`` a unit of work is a route instead (``_route``): the AGV locks a pallet,
reserves a route of two or three zones in one reservation (all or none, waiting without holding any),
drives it releasing each zone as it leaves it, and hands the pallet's lease to its forklift
(``{prefix}forklift-07``), which declines with ``decline_probability`` and otherwise accepts
(``accept_lock``), lifts the pallet and releases it. After each hand-off the AGV tries its own token
once more, which the server must refuse. Hand-offs need each agent to be its own owner (a dev-mode
server): with a token the AGV releases the pallet instead.

With ``charge_probability`` a unit of work is a charge instead: the AGV takes one of the ``plugs``
permits of a charging bay (``{prefix}bay:charging-{n}``, ``client.semaphore``), waiting briefly for a
plug, and holds it (with heartbeats) for a while. With ``inspect_probability`` it inspects a zone under
the zone's read lock (``client.read_lock``, many inspectors at once), or now and then re-lays it out
under the write lock (``client.write_lock``, alone). These shared locks are locks of their own, beside
the zones' mutexes that drives and routes take.

Each saga holds a lease of its own (``saga_lease``), heartbeated by the SDK; a saga that an error cut
short is recovered by the agent before its next unit of work, and one whose orchestrator is gone for
good (its agent halted at the end of the run) must be finished by the server: compensated, or ``stuck``
after a second lapse. At the end the simulator waits out that deadline (two saga leases and a margin for
the reaper) and counts every saga of the run still running or compensating as a violation
(``sagas_unfinished``).

Every grant an agent acts on goes through the ``Ledger`` (``ledger``): violations must be 0
against a correct server. The seed fixes every random choice, not the interleaving with the server.

Owners: without a token (a dev-mode server) each AGV is its own owner, ``{prefix}agv-07``; with a token
the server makes the token's name the owner of every lease, so all AGVs share one owner (the checks go
by fencing token and do not care).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from lockledger.client import AsyncClient, check_owner, check_resource
from lockledger.errors import (
    Forbidden,
    LeaseExpired,
    LockHeld,
    LockLedgerError,
    LockLost,
    NotFound,
    NotHolder,
    Unauthorized,
    ValidationError,
)
from lockledger.lease import AsyncLease
from lockledger.records import HandedOff
from lockledger.saga import AsyncSaga, SagaFailed, Step, StepContext, define, get_saga, list_sagas
from lockledger.simulate.faults import AgentCrashed, FaultyTransport, Wire
from lockledger.simulate.ledger import EXCLUSIVE, Ledger
from lockledger_breaker import BreakerConfig, CircuitBreaker, CircuitOpen

__all__ = ["Settings", "Simulation", "Summary"]

# How long things take, in seconds (uniform between the bounds).
_PICK_S = (0.02, 0.15)
_DRIVE_S = (0.05, 0.3)
_PICK_TIMEOUT_S = 2.0  # the pallet wait and the pick together
_DRIVE_TIMEOUT_S = 1.0  # the zone wait and the drive together: an occupied zone fails the drive
_PARK_WAIT_S = 0.5
_ROUTE_WAIT_S = 1.0  # the wait for a route's zones, all at once: a route still occupied puts the pallet back
_ROUTE_ZONES = (2, 3)  # zones on a route (fewer if there are fewer zones)
_LIFT_S = (0.02, 0.15)  # a forklift lifting a pallet it accepted
_PARK_TTLS = (0.5, 2.0)  # how long an AGV parks in a zone, in lease lengths (so its heartbeats run)
_CHARGE_TTLS = (0.5, 1.5)  # how long an AGV charges at a plug, in lease lengths
_INSPECT_S = (0.1, 0.6)  # an inspection under a zone's read lock
_RELAYOUT_S = (0.1, 0.4)  # a re-layout under a zone's write lock
_RELAYOUT_SHARE = 1 / 3  # of the zone visits for inspection, those that re-lay the zone out instead
_CRASH_AFTER_S = (0.0, 1.5)  # when, in a unit of work, a crash strikes
_RESTART_TTLS = (0.5, 1.5)  # how long a crashed AGV stays down, in lease lengths: before or after expiry
_GRACE_S = _PICK_TIMEOUT_S + _DRIVE_TIMEOUT_S + 2.0  # after the time is up, to finish the work at hand
# A saga abandoned at the end is finished by the server within two leases (compensated at the first
# lapse, stuck at the second), each noticed at the reaper's next pass: this margin covers the passes.
_SETTLE_MARGIN_S = 2.0
_ERROR_PAUSE_S = 0.5  # after an unexpected error (the server unreachable), before the next unit of work
_UNFINISHED = ("running", "compensating")
_SAGA_NAME = "sim-pallet-to-zone"
# A breaker that reopens soon: lost answers are failures to it, and an AGV must not sit out the run.
_BREAKER = BreakerConfig(wait_duration_in_open=1.0)
_FATAL = (Unauthorized, Forbidden)  # a refused token: every agent would fail alike
_MAX_PLUGS = 10_000  # a semaphore's most permits (the server's)


def _refused(detail: str) -> ValidationError:
    return ValidationError(0, {"code": "validation_error", "detail": detail})


@dataclass(frozen=True)
class Settings:
    """What to simulate. ``pallets`` and ``zones`` default to a few for many agents, so they contend."""

    agents: int = 8
    duration: float = 30.0  # seconds
    pallets: int | None = None  # default: agents // 2 (at least 2)
    zones: int | None = None  # default: agents // 3 (at least 2)
    prefix: str = "sim:"
    seed: int | None = None
    ttl: float = 2.0  # lease length, seconds: short, so crashed agents' leases expire within the run
    saga_lease: float = 3.0  # a saga's own lease, seconds: short, so the server finishes abandoned ones soon
    crash_probability: float = 0.05  # per unit of work (a saga, a route, or parking in a zone)
    drop_probability: float = 0.02  # per command
    park_probability: float = 0.2  # per unit of work: park in a zone rather than run a saga
    route_probability: float = 0.5  # per unit not parked: a reserved route and a hand-off, not a saga
    decline_probability: float = 0.2  # per hand-off: the forklift declines the pallet
    charge_probability: float = 0.1  # per unit not parked: charge at a bay's plug (a semaphore's permit)
    inspect_probability: float = 0.1  # per unit not parked or charging: inspect or re-lay out a zone
    bays: int | None = None  # charging bays; default: agents // 8 (at least 1)
    plugs: int = 4  # plugs per bay: the semaphore's permits

    @property
    def pallet_count(self) -> int:
        return self.pallets if self.pallets is not None else max(2, self.agents // 2)

    @property
    def zone_count(self) -> int:
        return self.zones if self.zones is not None else max(2, self.agents // 3)

    @property
    def bay_count(self) -> int:
        return self.bays if self.bays is not None else max(1, self.agents // 8)

    def check(self) -> None:
        """``ValidationError`` (status 0) for settings no simulation can run with."""
        if min(self.agents, self.pallet_count, self.zone_count, self.bay_count, self.plugs) < 1:
            raise _refused("agents, pallets, zones, bays and plugs are at least 1")
        if self.plugs > _MAX_PLUGS:
            raise _refused(f"plugs are at most {_MAX_PLUGS}")
        if not self.duration > 0 or not self.ttl >= 1.0 or not self.saga_lease >= 1.0:
            raise _refused(
                "duration is seconds > 0, ttl and saga_lease seconds >= 1 (the server's least lease)"
            )
        for name in (
            "crash_probability", "drop_probability", "park_probability", "route_probability",
            "decline_probability", "charge_probability", "inspect_probability",
        ):  # fmt: skip
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise _refused(f"{name} is between 0 and 1")
        try:
            check_resource(f"{self.prefix}pallet:{self.pallet_count}")
            check_owner(f"{self.prefix}agv-{self.agents}")
        except ValidationError:
            raise _refused(f"prefix {self.prefix!r:.80}: up to 180 of A-Z, a-z, 0-9 and . _ : -") from None


@dataclass
class Counts:
    """What the agents did and saw, beyond the wire."""

    sagas_started: int = 0
    sagas_completed: int = 0
    sagas_compensated: int = 0  # aborted after the pick was undone (the pallet put back)
    sagas_failed: int = 0  # aborted before there was anything to undo, stuck, or cut by an error
    sagas_recovered: int = 0  # a crashed incarnation's saga, finished from the log by the next one
    parked: int = 0
    routes_reserved: int = 0  # routes whose zones were all granted in one reservation
    routes_refused: int = 0  # reservations that waited in vain (the pallet was put back)
    zones_left: int = 0  # zones of a route released one by one as the AGV left them
    handoffs_given: int = 0  # pallets' leases handed to a forklift
    handoffs_accepted: int = 0
    handoffs_declined: int = 0
    giver_tokens_refused: int = 0  # the giver's token tried again after the hand-off, and refused
    charges: int = 0  # plugs taken: a bay's semaphore permits
    inspections: int = 0  # zones inspected under their read lock
    relayouts: int = 0  # zones re-laid out under their write lock
    waits_timed_out: int = 0  # a step or a parking gave up waiting for its lock
    leases_lost: int = 0  # a lease found lost while acting under it
    crashes: int = 0
    pallets_put_back: int = 0  # the pick's compensation ran (by the saga, or by a recovery)
    errors: int = 0  # a unit of work cut by an error other than the expected refusals
    sagas_unfinished: int = 0  # still running or compensating past the server's deadline: violations


Summary = dict[str, Any]
Progress = Callable[[Summary], None]


class _Checked(Protocol):
    """A lease or a reservation, as the agents check it before acting."""

    @property
    def lost(self) -> asyncio.Event: ...

    def check(self) -> None: ...


@dataclass
class _Incarnation:
    number: int
    holder: str  # the ledger's name for this life of the agent
    client: AsyncClient
    transport: FaultyTransport
    forklift: AsyncClient  # the AGV's forklift: its own owner, its network dies with the AGV's
    forklift_transport: FaultyTransport
    forklift_id: str
    forklift_holder: str

    def crash(self) -> None:
        self.transport.crash()
        self.forklift_transport.crash()

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.forklift.aclose()


class Simulation:
    """One run: ``summary = await Simulation(settings, url, token).run()``."""

    def __init__(self, settings: Settings, url: str, token: str | None = None) -> None:
        settings.check()
        self.settings = settings
        self.url = url
        self.token = token
        self.ledger = Ledger()
        self.wire = Wire()
        self.counts = Counts()
        self._seed = settings.seed if settings.seed is not None else random.randrange(2**32)
        self._run = uuid.uuid4().hex[:8]
        self._stop = asyncio.Event()
        self._halted = asyncio.Event()
        self._lives: dict[int, _Incarnation] = {}
        self._unfinished_examples: list[str] = []
        self._started = 0.0
        self._definition = define(
            _SAGA_NAME,
            [
                Step("pick", ["{pallet}"], compensate=self._put_back, timeout=_PICK_TIMEOUT_S, keep=True,
                     ttl=settings.ttl),
                Step("drive", ["{zone}"], timeout=_DRIVE_TIMEOUT_S, ttl=settings.ttl),
            ],
            register=False,
        )  # fmt: skip

    # --- the run -------------------------------------------------------------------------------------

    async def run(
        self, on_progress: Progress | None = None, every: float = 1.0, interruptible: bool = False
    ) -> Summary:
        """Run for ``settings.duration`` (then let the agents finish the work at hand, a few seconds at
        most); ``on_progress`` gets the summary so far every ``every`` seconds. With ``interruptible``, a
        first SIGINT stops early the same way and a second one stops at once."""
        async with AsyncClient(self.url, token=self.token, retry_attempts=2, retry_timeout=2.0) as probe:
            await probe.ready()  # an unreachable server is one error, not N agents failing
        loop = asyncio.get_running_loop()
        if interruptible:
            with contextlib.suppress(NotImplementedError):  # no signal handlers on this platform
                loop.add_signal_handler(signal.SIGINT, self.interrupt)
        self._started = time.monotonic()
        ticker = asyncio.create_task(self._tick(on_progress, every)) if on_progress else None
        try:
            with _quiet_sdk():
                await self._drive_agents()
                await self._settle_sagas()
        finally:
            if ticker is not None:
                ticker.cancel()
            if interruptible:
                with contextlib.suppress(NotImplementedError):
                    loop.remove_signal_handler(signal.SIGINT)
        return self.summary()

    def interrupt(self) -> None:
        """Stop early: the first call lets the agents finish the work at hand, the second halts them."""
        if self._stop.is_set():
            self._halt()
        self._stop.set()

    async def _drive_agents(self) -> None:
        agents = [asyncio.create_task(self._agent(index)) for index in range(1, self.settings.agents + 1)]
        stopped = asyncio.create_task(self._stop.wait())
        halted = asyncio.create_task(self._halted.wait())
        finished: asyncio.Task[Any] | None = None
        try:
            # Agents end early only on an error (or an interrupt): then the run ends too.
            await asyncio.wait(
                [*agents, stopped], timeout=self.settings.duration, return_when=asyncio.FIRST_COMPLETED
            )
            self._stop.set()
            finished = asyncio.create_task(asyncio.wait(agents))
            await asyncio.wait([finished, halted], timeout=_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._halt()  # whoever is still at work: their network is cut, and they are cancelled
            tasks = [*agents, stopped, halted, *([finished] if finished is not None else [])]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for agent in agents:  # a refused token ends the run as an error
            if not agent.cancelled() and (error := agent.exception()) is not None:
                raise error

    def _halt(self) -> None:
        """Cut every agent's network: whatever they are doing fails at once, their leases lapse."""
        self._halted.set()
        for life in self._lives.values():
            life.crash()

    async def _tick(self, on_progress: Progress, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            on_progress(self.summary())

    def summary(self) -> Summary:
        c, w = self.counts, self.wire
        return {
            "agents": self.settings.agents, "pallets": self.settings.pallet_count,
            "zones": self.settings.zone_count, "bays": self.settings.bay_count,
            "plugs": self.settings.plugs, "prefix": self.settings.prefix, "seed": self._seed,
            "elapsed_s": round(time.monotonic() - self._started, 3) if self._started else 0.0,
            "operations": w.requests, "grants": w.grants, "grants_checked": self.ledger.checked,
            "lock_held": w.lock_held, "waits_timed_out": c.waits_timed_out,
            "leases_lost": c.leases_lost, "crashes": c.crashes,
            "dropped_responses": w.dropped, "replayed_responses": w.replayed,
            "sagas_started": c.sagas_started, "sagas_completed": c.sagas_completed,
            "sagas_compensated": c.sagas_compensated, "sagas_failed": c.sagas_failed,
            "sagas_recovered": c.sagas_recovered, "pallets_put_back": c.pallets_put_back,
            "parked": c.parked, "routes_reserved": c.routes_reserved, "routes_refused": c.routes_refused,
            "zones_left": c.zones_left, "handoffs_given": c.handoffs_given,
            "handoffs_accepted": c.handoffs_accepted, "handoffs_declined": c.handoffs_declined,
            "giver_tokens_refused": c.giver_tokens_refused,
            "charges": c.charges, "inspections": c.inspections, "relayouts": c.relayouts,
            "shared_checked": self.ledger.shared_checked, "most_plugs_in_use": self.ledger.most_permits,
            "most_inspectors_together": self.ledger.most_readers,
            "reservations_checked": self.ledger.reservations_checked,
            "handoffs_checked": self.ledger.handoffs_checked,
            "errors": c.errors, "sagas_unfinished": c.sagas_unfinished,
            "violations": self.ledger.violations + c.sagas_unfinished,
            "violation_examples": [*self.ledger.examples, *self._unfinished_examples],
        }  # fmt: skip

    async def _settle_sagas(self) -> None:
        """Wait, at most until the server's deadline for sagas abandoned now (two saga leases and a
        margin), for every saga of this run to be finished; count those still unfinished then."""
        deadline = time.monotonic() + 2 * self.settings.saga_lease + _SETTLE_MARGIN_S
        run = f"sim-{self._run}-"
        async with AsyncClient(self.url, token=self.token, retry_attempts=2, retry_timeout=2.0) as client:
            while True:
                left = [
                    view.saga_id
                    for status in _UNFINISHED
                    for view in await list_sagas(client, status)
                    if view.saga_id.startswith(run)
                ]
                if not left or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(min(0.5, self.settings.saga_lease / 4))
        self.counts.sagas_unfinished = len(left)
        self._unfinished_examples = [
            f"saga {saga_id} unfinished past its lease deadline" for saga_id in left[:5]
        ]

    # --- one AGV -------------------------------------------------------------------------------------

    async def _agent(self, index: int) -> None:
        """Lives until the time is up. A crash ends a life; after a while down, the next life recovers the
        saga the last one left (also once the time is up, so no saga stays half-done on the server)."""
        rng = random.Random(f"{self._seed}:{index}")
        unfinished: str | None = None
        incarnation = 0
        while not self._halted.is_set():
            incarnation += 1
            life = self._born(index, incarnation, rng)
            self._lives[index] = life
            try:
                if unfinished is not None:
                    await self._recover(life, unfinished)
                    unfinished = None
                if self._stop.is_set():
                    return
                unfinished = await self._live(index, life, rng)
            finally:
                await life.aclose()
            if not life.transport.crashed or self._halted.is_set():
                return
            with contextlib.suppress(TimeoutError):  # down for a while, unless the run ends first
                await asyncio.wait_for(self._stop.wait(), rng.uniform(*_RESTART_TTLS) * self.settings.ttl)

    def _born(self, index: int, incarnation: int, rng: random.Random) -> _Incarnation:
        agent_id = f"{self.settings.prefix}agv-{index:02d}"
        forklift_id = f"{self.settings.prefix}forklift-{index:02d}"
        client, transport = self._connect(agent_id, rng)
        forklift, forklift_transport = self._connect(forklift_id, rng)
        return _Incarnation(
            incarnation, f"{agent_id}#{incarnation}", client, transport, forklift, forklift_transport,
            forklift_id, f"{forklift_id}#{incarnation}",
        )  # fmt: skip

    def _connect(self, agent_id: str, rng: random.Random) -> tuple[AsyncClient, FaultyTransport]:
        """A client for one simulated agent, over a faulty network of its own."""
        transport = FaultyTransport(
            httpx.AsyncHTTPTransport(), rng=rng, drop_probability=self.settings.drop_probability,
            wire=self.wire, ledger=self.ledger,
        )  # fmt: skip
        client = AsyncClient(
            self.url, token=self.token, agent_id=None if self.token else agent_id, transport=transport,
            retry_attempts=5, retry_timeout=5.0, breaker=CircuitBreaker(_BREAKER, name=agent_id),
        )  # fmt: skip
        return client, transport

    async def _live(self, index: int, life: _Incarnation, rng: random.Random) -> str | None:
        """Units of work until the time is up (None) or a crash (the id of the saga it cut, if any). After
        a unit an error cut short (the server was unreachable), the agent pauses, then recovers the saga
        it was running, if any, before the next unit of work (or once the time is up)."""
        sequence = 0
        cut: str | None = None
        while not self._stop.is_set():
            if cut is not None:
                await self._recover(life, cut)
                cut = None
            sequence += 1
            saga_id: str | None = None
            # (no draw for a kind of work whose probability is 0: a seed makes the same choices as before
            # it existed)
            if rng.random() < self.settings.park_probability:
                work = asyncio.create_task(self._park(life, rng))
            elif self.settings.charge_probability and rng.random() < self.settings.charge_probability:
                work = asyncio.create_task(self._charge(life, rng))
            elif self.settings.inspect_probability and rng.random() < self.settings.inspect_probability:
                work = asyncio.create_task(self._inspect(life, rng))
            elif self.settings.route_probability and rng.random() < self.settings.route_probability:
                work = asyncio.create_task(self._route(life, rng))
            else:
                saga_id = f"sim-{self._run}-{index:02d}-{life.number}-{sequence}"
                work = asyncio.create_task(self._move(life, saga_id, rng))
            crash_after = (
                rng.uniform(*_CRASH_AFTER_S) if rng.random() < self.settings.crash_probability else None
            )
            try:
                done, _ = await asyncio.wait({work}, timeout=crash_after)
                if not done:  # the crash strikes mid-work
                    self.counts.crashes += 1
                    self._crash(life)
            finally:
                if not work.done():
                    work.cancel()
                await asyncio.wait({work})
            error = None if work.cancelled() else work.exception()
            if life.transport.crashed:  # or halted: how the work unwound then is no outcome
                return saga_id
            if error is not None:
                raise error
            if work.result():
                cut = saga_id
                with contextlib.suppress(TimeoutError):  # not a busy loop against a dead server
                    await asyncio.wait_for(self._stop.wait(), _ERROR_PAUSE_S)
        if cut is not None:
            await self._recover(life, cut)
        return None

    def _crash(self, life: _Incarnation) -> None:
        life.crash()
        self.ledger.crashed(life.holder)
        self.ledger.crashed(life.forklift_holder)

    # --- parking in a zone ---------------------------------------------------------------------------

    async def _park(self, life: _Incarnation, rng: random.Random) -> bool:
        """Park in a zone for a while; whether an error cut it short."""
        lease = life.client.lock(self._zone(rng), ttl=self.settings.ttl, wait=_PARK_WAIT_S)

        def parked(lease: AsyncLease) -> None:
            self._observe(life, lease)
            self.counts.parked += 1

        ttl = self.settings.ttl
        return await self._hold(life, lease, parked, rng, (_PARK_TTLS[0] * ttl, _PARK_TTLS[1] * ttl))

    # --- charging, inspecting, re-laying out: shared locks ----------------------------------------------

    async def _charge(self, life: _Incarnation, rng: random.Random) -> bool:
        """Charge at a plug of a bay (a permit of its semaphore) for a while; whether an error cut it
        short."""
        bay, plugs, ttl = self._bay(rng), self.settings.plugs, self.settings.ttl
        permit = life.client.semaphore(bay, plugs, ttl=ttl, wait=_PARK_WAIT_S)

        def charging(permit: AsyncLease) -> None:
            self._observe_shared(life, permit, "shared", plugs)
            self.counts.charges += 1

        return await self._hold(life, permit, charging, rng, (_CHARGE_TTLS[0] * ttl, _CHARGE_TTLS[1] * ttl))

    async def _inspect(self, life: _Incarnation, rng: random.Random) -> bool:
        """Inspect a zone under its read lock, or re-lay it out under its write lock; whether an error cut
        it short."""
        zone, ttl = self._zone(rng), self.settings.ttl
        if rng.random() < _RELAYOUT_SHARE:
            lease, mode, span = (
                life.client.write_lock(zone, ttl=ttl, wait=_PARK_WAIT_S),
                EXCLUSIVE,
                _RELAYOUT_S,
            )
        else:
            lease, mode, span = life.client.read_lock(zone, ttl=ttl, wait=_PARK_WAIT_S), "shared", _INSPECT_S

        def inspecting(lease: AsyncLease) -> None:
            self._observe_shared(life, lease, mode, None)
            if mode == EXCLUSIVE:
                self.counts.relayouts += 1
            else:
                self.counts.inspections += 1

        return await self._hold(life, lease, inspecting, rng, span)

    async def _hold(
        self,
        life: _Incarnation,
        lease: AsyncLease,
        held: Callable[[AsyncLease], None],
        rng: random.Random,
        seconds: tuple[float, float],
    ) -> bool:
        """Take ``lease``, tell ``held``, act under it for a while; whether an error cut it short. A lock
        still taken after the wait counts as a wait that timed out."""
        try:
            async with lease:
                held(lease)
                await asyncio.sleep(rng.uniform(*seconds))
                self._check(lease)
        except LockHeld:
            self.counts.waits_timed_out += 1
        except LockLost:
            pass  # counted where it was found
        except _FATAL:
            raise
        except (LockLedgerError, CircuitOpen, AgentCrashed):
            if not life.transport.crashed:  # a crashed agent's unwinding is not an outcome
                self.counts.errors += 1
                return True
        return False

    # --- a reserved route and a hand-off -------------------------------------------------------------

    async def _route(self, life: _Incarnation, rng: random.Random) -> bool:
        """Lock a pallet, drive a reserved route with it, hand it to the forklift; whether an error cut it
        short. A route still occupied after the wait puts the pallet back (released at the block's exit)."""
        pallet, route = self._pallet(rng), self._route_zones(rng)
        handed: HandedOff | None = None
        try:
            async with life.client.lock(pallet, ttl=self.settings.ttl, wait=_PICK_TIMEOUT_S) as lease:
                self._observe(life, lease)
                await asyncio.sleep(rng.uniform(*_PICK_S))
                self._check(lease)
                if await self._drive_route(life, route, rng):
                    self._check(lease)
                    if self.token is None:  # with a token the forklift would be the AGV's own principal
                        handed = await self._hand_off(life, lease)
        except LockHeld:
            self.counts.waits_timed_out += 1
        except LockLost:
            pass  # counted where it was found
        except _FATAL:
            raise
        except (LockLedgerError, CircuitOpen, AgentCrashed):
            if not life.transport.crashed:
                self.counts.errors += 1
                return True
        if handed is None:
            return False
        return await self._forklift(life, handed, rng)

    async def _drive_route(self, life: _Incarnation, route: list[str], rng: random.Random) -> bool:
        """Reserve every zone of ``route`` at once, then drive through them, releasing each on leaving it;
        whether the route was driven (False: its zones stayed occupied for the whole wait)."""
        try:
            async with life.client.reserve(route, ttl=self.settings.ttl, wait=_ROUTE_WAIT_S) as reservation:
                if not life.transport.crashed:
                    self.ledger.reserved(route, reservation.tokens, life.holder, reservation)
                self.counts.routes_reserved += 1
                for zone in route:
                    await asyncio.sleep(rng.uniform(*_DRIVE_S) / len(route))
                    self._check(reservation)
                    await reservation.release(zone)
                    self.counts.zones_left += 1
        except LockHeld:
            self.counts.routes_refused += 1
            return False
        return True

    async def _hand_off(self, life: _Incarnation, lease: AsyncLease) -> HandedOff | None:
        """Hand the pallet's lease to the forklift, then try the old token once more: it must be refused.
        None if the lease was found lost on the way."""
        giver_token = lease.fencing_token
        try:
            handed = await lease.hand_off(life.forklift_id, accept_within=self.settings.ttl)
        except (LeaseExpired, NotHolder):
            self.counts.leases_lost += 1
            return None
        self.counts.handoffs_given += 1
        self.ledger.handed_off(lease.resource, giver_token, handed.fencing_token, life.forklift_holder)
        try:
            await life.client.renew(lease.resource, lease.owner, giver_token, self.settings.ttl)
        except (LeaseExpired, NotHolder):
            self.counts.giver_tokens_refused += 1
            self.ledger.giver_token_answered(lease.resource, giver_token, refused=True)
        else:
            self.ledger.giver_token_answered(lease.resource, giver_token, refused=False)
        return handed

    async def _forklift(self, life: _Incarnation, handed: HandedOff, rng: random.Random) -> bool:
        """The forklift the pallet was handed to: it declines sometimes; otherwise it accepts, lifts the
        pallet under the accepted lease and releases it. Whether an error cut it short."""
        forklift = life.forklift
        try:
            if rng.random() < self.settings.decline_probability:
                await forklift.decline(handed.resource, life.forklift_id)
                self.counts.handoffs_declined += 1
                return False
            async with forklift.accept_lock(handed.resource, ttl=self.settings.ttl) as lease:
                self.counts.handoffs_accepted += 1
                if not life.forklift_transport.crashed:
                    self.ledger.accepted(lease.resource, lease.fencing_token, life.forklift_holder, lease)
                await asyncio.sleep(rng.uniform(*_LIFT_S))
                self._check(lease)
        except LockLost:
            pass
        except _FATAL:
            raise
        except (LockLedgerError, CircuitOpen, AgentCrashed):
            if not life.forklift_transport.crashed:
                self.counts.errors += 1
                return True
        return False

    # --- the saga ------------------------------------------------------------------------------------

    async def _move(self, life: _Incarnation, saga_id: str, rng: random.Random) -> bool:
        """One saga; whether an error cut it short (then the agent recovers it next)."""
        pallet, zone = self._pallet(rng), self._zone(rng)
        params = {"pallet": pallet, "zone": zone}
        self.counts.sagas_started += 1
        lease = self.settings.saga_lease
        try:
            async with life.client.saga(saga_id, self._definition, params=params, lease=lease) as saga:
                await saga.step("pick", action=self._work(life, pallet, rng.uniform(*_PICK_S)),
                                compensate=self._put_back_under(life, saga, pallet))  # fmt: skip
                await saga.step("drive", action=self._work(life, zone, rng.uniform(*_DRIVE_S)))
        except SagaFailed as failed:
            if not life.transport.crashed:  # a crashed agent's unwinding is not an outcome
                self._count_failed(failed)
        except _FATAL:
            raise
        except (LockLedgerError, CircuitOpen, AgentCrashed):
            if not life.transport.crashed:
                self.counts.sagas_failed += 1
                self.counts.errors += 1
                return True
        else:
            self.counts.sagas_completed += 1
        return False

    def _count_failed(self, failed: SagaFailed) -> None:
        if failed.reason == "timeout":
            self.counts.waits_timed_out += 1
        picked = failed.view is not None and failed.view.step("pick").status == "compensated"
        if picked and failed.view is not None and failed.view.status == "aborted":
            self.counts.sagas_compensated += 1
        else:
            self.counts.sagas_failed += 1

    def _work(self, life: _Incarnation, resource: str, seconds: float) -> Callable[[StepContext], Any]:
        """A step's action: act on ``resource`` for a while under its lease, and say what was done."""

        async def act(ctx: StepContext) -> dict[str, Any]:
            lease = ctx.leases[resource]
            self._observe(life, lease)
            await asyncio.sleep(seconds)
            self._check(lease)
            return {"resource": resource, "fencing_token": lease.fencing_token}

        return act

    def _put_back_under(self, life: _Incarnation, saga: AsyncSaga, pallet: str) -> Callable[[Any], Any]:
        """The pick's compensation as this orchestrator runs it: under the pallet's lease, if still held."""

        async def put_back(result: dict[str, Any] | None) -> None:
            lease = saga.leases.get(pallet)
            if lease is not None:
                self._observe(life, lease)
            await self._put_back(result)

        return put_back

    async def _put_back(self, result: dict[str, Any] | None) -> None:
        """Idempotent: a pallet already on its dock stays there (a recovering orchestrator may repeat it)."""
        self.counts.pallets_put_back += 1

    async def _recover(self, life: _Incarnation, saga_id: str) -> None:
        """Finish the saga the previous incarnation was running when it crashed, from the log alone."""
        try:
            view = await get_saga(life.client, saga_id)
            if view.finished:
                return
            await life.client.saga(saga_id, self._definition, lease=self.settings.saga_lease).recover(view)
        except NotFound:  # the crash came before the server heard of it
            return
        except _FATAL:
            raise
        except (SagaFailed, LockLedgerError, CircuitOpen, AgentCrashed):
            self.counts.errors += 1
            return
        self.counts.sagas_recovered += 1

    # --- observations --------------------------------------------------------------------------------

    def _observe(self, life: _Incarnation, lease: AsyncLease) -> None:
        if not life.transport.crashed:
            self.ledger.granted(lease.resource, lease.fencing_token, life.holder, lease)

    def _observe_shared(self, life: _Incarnation, lease: AsyncLease, mode: str, limit: int | None) -> None:
        if not life.transport.crashed:
            self.ledger.shared_granted(lease.resource, lease.fencing_token, life.holder, lease, mode, limit)

    def _check(self, lease: _Checked) -> None:
        if lease.lost.is_set():
            self.counts.leases_lost += 1
        lease.check()

    def _pallet(self, rng: random.Random) -> str:
        return f"{self.settings.prefix}pallet:{rng.randrange(self.settings.pallet_count)}"

    def _zone(self, rng: random.Random) -> str:
        return f"{self.settings.prefix}zone:{rng.randrange(self.settings.zone_count)}"

    def _bay(self, rng: random.Random) -> str:
        return f"{self.settings.prefix}bay:charging-{rng.randrange(self.settings.bay_count)}"

    def _route_zones(self, rng: random.Random) -> list[str]:
        """Two or three distinct zones, in driving order (fewer when there are fewer zones)."""
        count = self.settings.zone_count
        length = rng.randint(min(_ROUTE_ZONES[0], count), min(_ROUTE_ZONES[1], count))
        return [f"{self.settings.prefix}zone:{z}" for z in rng.sample(range(count), length)]


@contextlib.contextmanager
def _quiet_sdk() -> Iterator[None]:
    """The SDK warns of every lost lease and failed release; in a simulation that breaks them on
    purpose, those warnings are the expected noise, and the summary counts them."""
    sdk = logging.getLogger("lockledger")
    level = sdk.level
    sdk.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        sdk.setLevel(level)
