"""`lockledger simulate`: a short, fault-heavy run against a real dev-mode server keeps every invariant,
and the server's own log agrees with what the simulator counted, with sagas alone and with reserved
routes, hand-offs, charging bays (semaphores) and zone inspections (read/write locks); the invariant
ledger fails when two agents are handed one resource at once, a reservation is granted in part, a
hand-off's token is not above the giver's, a bay has more holders than plugs or a reader holds with a
writer, so its zero means something."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockledger.simulate.ledger import Ledger
from tests.servers import ServerProcess

pytestmark = pytest.mark.storage

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("LOCKLEDGER_URL", "LOCKLEDGER_TOKEN")}
# Two zones for six AGVs, for 8 s: they still contend (a parked AGV holds a zone for seconds, so drives
# time out and picks are compensated). With one zone for 4 s, a parked AGV and the leases crashed AGVs
# leave until their TTL kept nearly every drive out: one saga completed in most runs, none in about one
# run in five. Measured with these settings: 4-6 completed and 3-7 compensated in every run.
PALLETS, ZONES = 3, 2


def _simulate(server: ServerProcess, prefix: str, *options: str) -> subprocess.CompletedProcess[str]:
    args = [
        "simulate", "--agents", "6", "--duration", "8", "--seed", "7", "--prefix", prefix,
        "--format", "json", "--url", server.base_url, *options,
    ]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "lockledger.cli", *args],
        env=ENV, cwd=ROOT, text=True, capture_output=True, timeout=120,
    )  # fmt: skip


def _history(http: httpx.Client, resource: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    after = 0
    while True:
        response = http.get(f"/v1/locks/{resource}/history", params={"after_version": after, "limit": 1000})
        if response.status_code == 404:  # never locked
            return events
        response.raise_for_status()
        page = response.json()
        events += page["events"]
        if page["next_after_version"] is None or not page["events"]:
            return events
        after = page["next_after_version"]


@pytest.mark.slow
def test_a_short_simulation_with_every_fault_keeps_the_invariants_and_agrees_with_the_log(
    server: ServerProcess, unique_prefix: str
) -> None:
    run = _simulate(
        server, unique_prefix, "--pallets", str(PALLETS), "--zones", str(ZONES), "--crash-probability", "0.3",
        "--drop-probability", "0.2", "--route-probability", "0", "--charge-probability", "0",
        "--inspect-probability", "0",
    )  # fmt: skip

    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["violations"] == 0, summary["violation_examples"]
    assert summary["sagas_unfinished"] == 0
    assert summary["grants"] > 0
    assert summary["grants_checked"] > 0
    assert summary["lock_held"] + summary["waits_timed_out"] > 0
    assert summary["dropped_responses"] > 0
    assert summary["replayed_responses"] > 0
    assert summary["crashes"] > 0
    assert summary["sagas_compensated"] > 0
    assert summary["pallets_put_back"] >= summary["sagas_compensated"]

    resources = [f"{unique_prefix}pallet:{n}" for n in range(PALLETS)]
    resources += [f"{unique_prefix}zone:{n}" for n in range(ZONES)]
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        acquired = 0
        for resource in resources:
            events = _history(http, resource)
            tokens = [e["data"]["fencing_token"] for e in events if e["type"] == "LOCK_ACQUIRED"]
            assert tokens == sorted(set(tokens)), f"{resource}: fencing tokens {tokens}"
            acquired += len(tokens)
        # A grant the simulator counted is one the log holds; a crash can cut an answer, not an event.
        assert summary["grants_checked"] <= summary["grants"] <= acquired
        # Every saga a crash left half-done was finished by the agent's next life.
        owners = [f"{unique_prefix}agv-{n:02d}" for n in range(1, 7)]
        for owner in owners:
            for status in ("running", "compensating"):
                left = http.get("/v1/sagas", params={"owner": owner, "status": status}).json()["items"]
                assert left == [], f"{owner}: {status} sagas {[s['saga_id'] for s in left]}"
        completed = sum(
            len(
                http.get("/v1/sagas", params={"owner": owner, "status": "completed", "limit": 100}).json()[
                    "items"
                ]
            )
            for owner in owners
        )
        assert 0 < summary["sagas_completed"] <= completed


# Routes of two or three zones out of eight: routes still cross, so some reservations wait or are refused,
# and most get through. Every unit of work not parked, charging or inspecting is a route and half the
# hand-offs are declined. One bay of two plugs for six AGVs, so charges wait for a plug.
# Measured with these settings (four runs): 8-12 hand-offs, 3-5 accepted and 5-9 declined, 9-13 routes
# reserved, 1-2 refused; 4-7 charges (2 plugs in use at once), 6-11 inspections, 1-3 re-layouts.
ROUTE_PALLETS, ROUTE_ZONES, PLUGS = 8, 8, 2


@pytest.mark.slow
def test_a_short_simulation_reserves_routes_hands_off_charges_and_inspects_keeping_the_invariants(
    server: ServerProcess, unique_prefix: str
) -> None:
    run = _simulate(
        server, unique_prefix, "--pallets", str(ROUTE_PALLETS), "--zones", str(ROUTE_ZONES),
        "--crash-probability", "0.1", "--drop-probability", "0.1", "--route-probability", "1",
        "--decline-probability", "0.5", "--charge-probability", "0.2", "--inspect-probability", "0.35",
        "--bays", "1", "--plugs", str(PLUGS),
    )  # fmt: skip

    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["violations"] == 0, summary["violation_examples"]
    assert summary["routes_reserved"] > 0
    assert summary["reservations_checked"] > 0
    assert summary["zones_left"] > 0
    assert summary["handoffs_given"] > 0
    assert summary["handoffs_checked"] == summary["handoffs_given"]
    assert summary["handoffs_accepted"] > 0
    assert summary["handoffs_declined"] > 0
    assert summary["handoffs_accepted"] + summary["handoffs_declined"] <= summary["handoffs_given"]
    assert 0 < summary["giver_tokens_refused"] <= summary["handoffs_given"]
    assert summary["sagas_started"] == 0
    assert summary["charges"] > 0
    assert summary["inspections"] > 0
    assert summary["relayouts"] > 0
    assert summary["shared_checked"] > 0
    assert 0 < summary["most_plugs_in_use"] <= PLUGS

    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        handed_off = reserved = 0
        for resource in [f"{unique_prefix}pallet:{n}" for n in range(ROUTE_PALLETS)]:
            events = _history(http, resource)
            grants = [e["data"] for e in events if e["type"] in ("LOCK_ACQUIRED", "LOCK_HANDED_OFF")]
            tokens = [grant["fencing_token"] for grant in grants]
            assert tokens == sorted(set(tokens)), f"{resource}: fencing tokens {tokens}"
            for grant in grants:
                if "from_token" in grant:
                    assert grant["fencing_token"] > grant["from_token"]
                    handed_off += 1
        for resource in [f"{unique_prefix}zone:{n}" for n in range(ROUTE_ZONES)]:
            events = _history(http, resource)
            tokens = [e["data"]["fencing_token"] for e in events if e["type"] == "LOCK_ACQUIRED"]
            assert tokens == sorted(set(tokens)), f"{resource}: fencing tokens {tokens}"
            reserved += sum(
                1 for e in events if e["type"] == "LOCK_ACQUIRED" and e["metadata"].get("reservation_id")
            )
        # Every hand-off and every reserved zone the simulator saw is in the log.
        assert summary["handoffs_given"] <= handed_off
        assert 2 * summary["routes_reserved"] <= reserved


@dataclass
class _Lease:
    """What the ledger reads of a lease: its local deadline and whether it was lost."""

    deadline: float
    lost: threading.Event = field(default_factory=threading.Event)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_ledger_flags_a_grant_while_another_agent_still_holds_the_lease() -> None:
    clock = _Clock()
    ledger = Ledger(clock)
    ledger.granted("zone:1", 5, "agv-1#1", _Lease(deadline=110.0))
    clock.now = 105.0
    ledger.granted("zone:1", 6, "agv-2#1", _Lease(deadline=115.0))

    assert ledger.checked == 2
    assert ledger.violations == 1
    assert "agv-1#1 still holds token 5" in ledger.examples[0]


def test_the_ledger_flags_a_fencing_token_that_does_not_increase() -> None:
    ledger = Ledger(_Clock())
    ledger.granted("pallet:1", 7, "agv-1#1", _Lease(deadline=110.0))
    ledger.released("pallet:1", 7)
    ledger.granted("pallet:1", 7, "agv-2#1", _Lease(deadline=110.0))  # the same token to someone else
    ledger.granted("pallet:1", 3, "agv-3#1", _Lease(deadline=110.0))  # an older one

    assert ledger.violations == 3  # the two tokens, and agv-2 still holding when agv-3 is granted
    assert ledger.examples[:2] == [
        "pallet:1: token 7 granted to agv-1#1 and again to agv-2#1",
        "pallet:1: token 3 to agv-3#1 after token 7",
    ]


def test_the_ledger_flags_a_reservation_granted_in_part() -> None:
    ledger = Ledger(_Clock())
    route = _Lease(deadline=110.0)
    ledger.reserved(["zone:1", "zone:2", "zone:3"], {"zone:1": 4, "zone:3": 9}, "agv-1#1", route)

    assert ledger.reservations_checked == 1
    assert ledger.violations == 1
    assert ledger.examples == [
        "reservation by agv-1#1: asked for ['zone:1', 'zone:2', 'zone:3'], granted ['zone:1', 'zone:3']"
    ]
    assert ledger.checked == 2  # the leases it did get are still checked as grants


def test_the_ledger_flags_a_hand_off_whose_token_is_not_above_the_givers() -> None:
    ledger = Ledger(_Clock())
    ledger.granted("pallet:1", 7, "agv-1#1", _Lease(deadline=110.0))
    ledger.released("pallet:1", 7)  # the hand-off is sent
    ledger.handed_off("pallet:1", 7, 7, "forklift-1#1")
    ledger.accepted("pallet:1", 7, "forklift-1#1", _Lease(deadline=110.0))

    assert ledger.handoffs_checked == 1
    assert ledger.examples == [
        "pallet:1: handed to forklift-1#1 with token 7, not above the giver's 7",
        "pallet:1: token 7 granted to agv-1#1 and again to forklift-1#1",
    ]


def test_the_ledger_flags_an_accepted_token_other_than_the_handed_one_and_a_giver_token_not_refused() -> None:
    ledger = Ledger(_Clock())
    ledger.granted("pallet:1", 7, "agv-1#1", _Lease(deadline=110.0))
    ledger.released("pallet:1", 7)
    ledger.handed_off("pallet:1", 7, 8, "forklift-1#1")
    ledger.giver_token_answered("pallet:1", 7, refused=False)
    ledger.accepted("pallet:1", 9, "forklift-1#1", _Lease(deadline=110.0))

    assert ledger.examples == [
        "pallet:1: the giver's token 7 was accepted after its hand-off",
        "pallet:1: forklift-1#1 accepted token 9, handed token 8",
    ]


def test_the_ledger_accepts_an_honest_reservation_and_hand_off() -> None:
    """Every zone of a route granted, left one by one and taken by the next vehicle; a pallet handed to a
    forklift with a higher token, the giver's token refused, the forklift accepting that token."""
    ledger = Ledger(_Clock())
    route = _Lease(deadline=110.0)
    ledger.reserved(["zone:1", "zone:2"], {"zone:1": 3, "zone:2": 5}, "agv-1#1", route)
    ledger.released("zone:1", 3)
    ledger.granted("zone:1", 4, "agv-2#1", _Lease(deadline=110.0))
    ledger.granted("pallet:1", 2, "agv-1#1", _Lease(deadline=110.0))
    ledger.released("pallet:1", 2)
    ledger.handed_off("pallet:1", 2, 3, "forklift-1#1")
    ledger.giver_token_answered("pallet:1", 2, refused=True)
    ledger.accepted("pallet:1", 3, "forklift-1#1", _Lease(deadline=110.0))

    assert (ledger.reservations_checked, ledger.handoffs_checked, ledger.checked) == (1, 1, 5)
    assert ledger.violations == 0, ledger.examples


def test_the_ledger_flags_a_permit_over_the_limit_and_a_reader_with_a_writer() -> None:
    ledger = Ledger(_Clock())
    for token, agv in enumerate(("agv-1#1", "agv-2#1", "agv-3#1"), start=1):
        ledger.shared_granted("bay:charging-0", token, agv, _Lease(deadline=110.0), "shared", 2)
    ledger.shared_granted("zone:1", 1, "inspector-1#1", _Lease(deadline=110.0), "shared", None)
    ledger.shared_granted("zone:1", 2, "relayout-1#1", _Lease(deadline=110.0), "exclusive", None)
    ledger.shared_granted("zone:1", 3, "inspector-2#1", _Lease(deadline=110.0), "shared", None)

    assert ledger.examples == [
        "shared/bay:charging-0: agv-3#1 granted token 3 as grant 3 of 2",
        "shared/zone:1: relayout-1#1 granted token 2 while inspector-1#1 still holds token 1 for 10.000 s",
        "shared/zone:1: inspector-2#1 granted token 3 while relayout-1#1 still holds token 2 for 10.000 s",
    ]
    assert ledger.most_permits == 3


def test_the_ledger_accepts_readers_together_permits_up_to_the_limit_and_a_writer_after_them() -> None:
    """Readers and permits hold together; a writer follows their release; a shared lock is not the mutex
    of the same name, and tokens increase across both modes."""
    ledger = Ledger(_Clock())
    ledger.shared_granted("bay:charging-0", 1, "agv-1#1", _Lease(deadline=110.0), "shared", 2)
    ledger.shared_granted("bay:charging-0", 2, "agv-2#1", _Lease(deadline=110.0), "shared", 2)
    ledger.released("bay:charging-0", 1, shared=True)
    ledger.shared_granted("bay:charging-0", 3, "agv-3#1", _Lease(deadline=110.0), "shared", 2)
    ledger.shared_granted("zone:1", 1, "inspector-1#1", _Lease(deadline=110.0), "shared", None)
    ledger.shared_granted("zone:1", 2, "inspector-2#1", _Lease(deadline=110.0), "shared", None)
    ledger.granted("zone:1", 1, "agv-4#1", _Lease(deadline=110.0))  # the zone's mutex: another lock
    for token in (1, 2):
        ledger.released("zone:1", token, shared=True)
    ledger.shared_granted("zone:1", 3, "relayout-1#1", _Lease(deadline=110.0), "exclusive", None)

    assert ledger.violations == 0, ledger.examples
    assert (ledger.shared_checked, ledger.checked) == (6, 7)
    assert (ledger.most_permits, ledger.most_readers) == (2, 2)


def test_the_ledger_accepts_every_honest_handover() -> None:
    """Released, expired by its deadline, lost, or abandoned by a crash: the next grant is fine, and so is
    an agent seeing its own grant twice."""
    clock = _Clock()
    ledger = Ledger(clock)
    first = _Lease(deadline=110.0)
    ledger.granted("zone:1", 1, "agv-1#1", first)
    ledger.granted("zone:1", 1, "agv-1#1", first)
    ledger.released("zone:1", 1)
    ledger.granted("zone:1", 2, "agv-2#1", _Lease(deadline=120.0))
    clock.now = 120.0  # its deadline has come
    lost = _Lease(deadline=140.0)
    ledger.granted("zone:1", 3, "agv-3#1", lost)
    lost.lost.set()
    ledger.granted("zone:1", 4, "agv-1#1", _Lease(deadline=150.0))
    ledger.crashed("agv-1#1")
    ledger.granted("zone:1", 5, "agv-1#2", _Lease(deadline=160.0))

    assert ledger.checked == 5
    assert ledger.violations == 0
