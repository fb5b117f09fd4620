"""Which HTTP client costs the load generator less CPU per request: measured, not assumed.

Both clients drive the no-op endpoint for a short cell with the same W; the one with the lower client CPU
per request drives every HTTP cell of the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.cell import CellSpec, run_cell
from bench.http_client import CLIENT_KINDS, make_client
from bench.targets.http_api import NOOP_PREFIX, HttpLockTarget
from bench.workload import resource_names

AIOHTTP_BUDGET_MS = 0.15  # above this much client CPU per request, aiohttp would be the bottleneck


async def calibrate(
    host: str,
    port: int,
    *,
    workers: int,
    duration_s: float,
    timeout_s: float,
    process_groups: dict[str, int | None],
    run_id: str,
    tokens: Sequence[str],
) -> dict[str, Any]:
    """``{"<kind>": {"cpu_ms_per_request", "requests_per_s", "errors"}, ..., "chosen": kind}``."""
    result: dict[str, Any] = {"workers": workers, "duration_s": duration_s}
    resources = resource_names(f"{run_id}-calibrate-", 100_000)
    for kind in CLIENT_KINDS:
        target = HttpLockTarget(
            "noop", NOOP_PREFIX, make_client(kind, host, port, timeout_s), f"{run_id}c{kind}", 30_000, tokens
        )
        spec = CellSpec("noop", "uniform", len(resources), workers, None, duration_s, 0.3, 0)
        cell = await run_cell(spec, target, resources, process_groups, drain_timeout_s=10, seed=7)
        await target.close()
        result[kind] = {
            "cpu_ms_per_request": cell["loadgen_cpu_ms_per_request"],
            "requests_per_s": cell["requests_per_s"],
            "errors": cell["errors"],
        }
    usable = [
        k for k in CLIENT_KINDS if result[k]["cpu_ms_per_request"] is not None and not result[k]["errors"]
    ]
    if not usable:
        raise RuntimeError(f"no HTTP client worked against the no-op endpoint: {result}")
    result["chosen"] = min(usable, key=lambda k: result[k]["cpu_ms_per_request"])
    result["aiohttp_over_budget"] = (result["aiohttp"]["cpu_ms_per_request"] or 0) > AIOHTTP_BUDGET_MS
    return result
