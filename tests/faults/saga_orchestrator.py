"""An orchestrator process for the saga crash tests: runs one saga, or recovers the agent's sagas.

    python -m tests.faults.saga_orchestrator run --url U --agent A --saga S --prefix P --effects F
        [--kill-at POINT] [--fail-at STEP] [--policy compensate|forward]
    python -m tests.faults.saga_orchestrator recover --url U --agent A --prefix P --effects F [--policy ...]

The saga has three steps: ``pick`` (locks ``<P>pallet``, kept), ``drive`` (``<P>zone``), ``drop``
(``<P>dock``). Every action and compensation appends one JSON line to the effects file (saga, step, kind,
whether it changed the world). Both are idempotent, as a saga's must be: an action whose effect is
already in the file, or a compensation whose undo is, applies nothing again.

``--kill-at`` makes the process SIGKILL itself at a step boundary: ``before:<step>`` (its locks taken,
nothing done), ``after:<step>`` (its effect applied, completion not reported), ``between:<step>`` (its
completion reported, the next step not started; ``between:drop`` is before the saga's completion), or
``compensate:<step>`` (the undo applied, its completion not reported; with ``--fail-at``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lockledger
from lockledger.saga import Policy, SagaDefinition, SagaFailed, Step, StepContext, define

STEPS = ("pick", "drive", "drop")
LOCKS = {"pick": "{prefix}pallet", "drive": "{prefix}zone", "drop": "{prefix}dock"}


class World:
    """The effects file: the record of what actions and compensations did."""

    def __init__(self, path: Path, kill_at: str | None, fail_at: str | None) -> None:
        self.path = path
        self.kill_at = kill_at
        self.fail_at = fail_at

    def lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def applied(self, saga: str, step: str, kind: str) -> bool:
        return any(e["saga"] == saga and e["step"] == step and e["kind"] == kind and e["applied"]
                   for e in self.lines())  # fmt: skip

    def record(self, saga: str, step: str, kind: str, applied: bool) -> None:
        line = json.dumps({"saga": saga, "step": step, "kind": kind, "applied": applied, "pid": os.getpid()})
        with self.path.open("a") as f:
            f.write(line + "\n")

    def maybe_die(self, point: str) -> None:
        if self.kill_at == point:
            print(f"KILLED AT {point}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def action(self, step: str) -> Any:
        async def act(ctx: StepContext) -> dict[str, Any]:
            self.maybe_die(f"before:{step}")
            if self.fail_at == step:
                self.record(ctx.saga_id, step, "action", False)
                raise RuntimeError(f"{step} failed on purpose")
            fresh = not self.applied(ctx.saga_id, step, "action")
            self.record(ctx.saga_id, step, "action", fresh)
            self.maybe_die(f"after:{step}")
            return {"step": step}

        return act

    def compensation(self, step: str) -> Any:
        async def undo(result: dict[str, Any] | None) -> None:
            assert result is not None
            assert result["step"] == step, result
            saga = self.saga_of(step, result)
            fresh = not self.applied(saga, step, "compensate")
            self.record(saga, step, "compensate", fresh)
            self.maybe_die(f"compensate:{step}")

        return undo

    def saga_of(self, step: str, result: dict[str, Any]) -> str:
        """Compensations get only the result: it names the saga through the action's line."""
        return str(result["saga"])


def definition(world: World, prefix: str, policy: Policy) -> SagaDefinition:
    steps = []
    for name in STEPS:
        action, undo = world.action(name), world.compensation(name)

        async def tagged(ctx: StepContext, action: Any = action) -> dict[str, Any]:
            result: dict[str, Any] = await action(ctx)
            return {**result, "saga": ctx.saga_id}

        lock = LOCKS[name].format(prefix=prefix)
        steps.append(Step(name, [lock], tagged, undo, timeout=10.0, keep=name == "pick", ttl=30.0))
    return define(f"crash-test-{policy}", steps, policy=policy, register=False)


async def run(args: argparse.Namespace, world: World) -> int:
    saga_definition = definition(world, args.prefix, args.policy)
    async with lockledger.AsyncClient(args.url, agent_id=args.agent) as client:
        try:
            async with client.saga(args.saga, saga_definition) as saga:
                for step in STEPS:
                    await saga.step(step)
                    world.maybe_die(f"between:{step}")
        except SagaFailed as error:
            print(f"FAILED {error.step}", flush=True)
            return 3
    print("COMPLETED", flush=True)
    return 0


async def recover(args: argparse.Namespace, world: World) -> int:
    saga_definition = definition(world, args.prefix, args.policy)
    async with lockledger.AsyncClient(args.url, agent_id=args.agent) as client:
        views = await client.recover_sagas([saga_definition])
    for view in views:
        print(f"RECOVERED {view.saga_id} {view.status}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["run", "recover"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--agent", required=True)
    parser.add_argument("--saga", default="")
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--effects", type=Path, required=True)
    parser.add_argument("--kill-at")
    parser.add_argument("--fail-at")
    parser.add_argument("--policy", default="compensate", choices=["compensate", "forward"])
    args = parser.parse_args(argv)
    world = World(args.effects, args.kill_at, args.fail_at)
    return asyncio.run(run(args, world) if args.mode == "run" else recover(args, world))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
