"""An AGV moves a pallet into a zone as a saga, and the zone is taken: the pallet is put back.

    .venv/bin/python examples/agv_pallet_to_zone.py --url http://127.0.0.1:8000

from a checkout, with the environment `make run` made (any Python with the SDK installed will do).

With authentication on, the token comes from ``LOCKLEDGER_TOKEN`` (an agent token); a dev-mode server
(``make run``) needs none. The story: the AGV picks pallet 42 (lock ``pallet:42``, kept for the next
step); another agent already occupies ``zone:B1`` (this script makes that happen with a second client);
the drive step waits for the zone until its timeout and fails; the pick is compensated (the pallet is put
back) and every lock of the saga is released. The saga's timeline is printed from ``GET /v1/sagas/{id}``.
Exits 0 when the story ran as told.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from datetime import UTC
from typing import Any

import lockledger
from lockledger.saga import SagaDefinition, SagaFailed, Step, StepContext, define, get_saga

SERVER_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"  # how the server writes an instant
put_back_calls: list[dict[str, Any] | None] = []


async def pick_up(ctx: StepContext) -> dict[str, Any]:
    """Lift the pallet off its dock; the result is what ``put_back`` needs to undo it."""
    pallet = f"pallet:{ctx.params['pallet']}"
    print(f"  pick: lifting {pallet} from dock:3 (fencing token {ctx.fencing_token(pallet)})")
    return {"pallet": ctx.params["pallet"], "from": "dock:3"}


async def put_back(result: dict[str, Any] | None) -> None:
    """Idempotent: putting a pallet on the dock it is already on changes nothing."""
    put_back_calls.append(result)
    assert result is not None
    print(f"  compensate pick: putting pallet {result['pallet']} back on {result['from']}")


async def drive_to_zone(ctx: StepContext) -> dict[str, Any]:
    zone = f"zone:{ctx.params['zone']}"
    print(f"  drive: entering {zone}")
    return {"zone": ctx.params["zone"]}


async def drive_back(result: dict[str, Any] | None) -> None:
    print(f"  compensate drive: leaving zone {result}")


def pallet_to_zone(drive_timeout: float) -> SagaDefinition:
    pick = Step("pick", ["pallet:{pallet}"], pick_up, put_back, timeout=10.0, keep=True)
    drive = Step("drive", ["zone:{zone}"], drive_to_zone, drive_back, timeout=drive_timeout)
    return define("pallet-to-zone", [pick, drive])


async def main(url: str, pallet: str, zone: str, drive_timeout: float) -> int:
    token = os.environ.get("LOCKLEDGER_TOKEN") or None
    saga_id = f"move-pallet-{pallet}-{uuid.uuid4().hex[:8]}"
    definition = pallet_to_zone(drive_timeout)
    async with (
        lockledger.AsyncClient(url, token=token, agent_id=None if token else "agv-17") as agv,
        lockledger.AsyncClient(url, token=token, agent_id=None if token else "agv-23") as other,
        other.lock(f"zone:{zone}", ttl=30) as blocker,
    ):
        print(f"{blocker.owner} occupies zone:{zone}")
        print(f"saga {saga_id}:")
        failed: SagaFailed | None = None
        try:
            async with agv.saga(saga_id, definition, params={"pallet": pallet, "zone": zone}) as saga:
                await saga.step("pick")
                await saga.step("drive")
        except SagaFailed as error:
            failed = error
            print(f"  saga failed at step {error.step}: {error.reason}")
        view = await get_saga(agv, saga_id)
        print(f"saga {view.saga_id} is {view.status}")
        print("timeline (GET /v1/sagas/{id}):")
        for event in view.timeline:
            at = event.recorded_at.astimezone(UTC).strftime(SERVER_TIME)
            print(f"  {at}  {event.type:<24} {event.data.get('step', '')}".rstrip())
        pallet_lock = await agv.get_lock(f"pallet:{pallet}")
        zone_lock = await agv.get_lock(f"zone:{zone}")
        print(f"pallet:{pallet} is {pallet_lock.status}; zone:{zone} is {zone_lock.status}", end=" ")
        print(f"by {zone_lock.owner}")
        told = (
            failed is not None
            and failed.step == "drive"
            and view.status == "aborted"
            and [s.status for s in view.steps] == ["compensated", "failed"]
            and put_back_calls == [view.step("pick").result]
            and pallet_lock.status != "held"
            and zone_lock.status == "held"
            and zone_lock.owner == blocker.owner
        )
    print("the story ran as told" if told else "the story did NOT run as told")
    return 0 if told else 1


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=os.environ.get("LOCKLEDGER_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--pallet", default="42")
    parser.add_argument("--zone", default="B1")
    parser.add_argument("--drive-timeout", type=float, default=5.0, help="seconds")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    sys.exit(asyncio.run(main(args.url, args.pallet, args.zone, args.drive_timeout)))
