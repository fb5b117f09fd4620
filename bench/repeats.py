"""Several runs of each cell, and the one that stands for them.

This machine's throughput wanders by 15 to 25 % between runs of the same cell, enough to move a ratio of
two cells by as much. ``--repeat K`` runs every cell K times, interleaved (each target once at a given
mode and W, then all again), so that slow spells fall on every target alike; each (target, mode, W,
server workers) is then represented by its median run, with every run's cycles/s beside it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bench.ratios import cell_key

Cell = dict[str, Any]


def median_cells(cells: list[Cell]) -> list[Cell]:
    """One cell per (target, mode, W, server workers), in first-run order: the run with the median
    cycles/s (the lower of the two middle ones for an even count), with ``runs`` and ``cycles_per_s_runs``
    (ascending) added when there was more than one run."""
    groups: dict[tuple[str, str, int, int | None], list[Cell]] = defaultdict(list)
    for cell in cells:
        groups[cell_key(cell)].append(cell)
    chosen = []
    for runs in groups.values():
        if len(runs) == 1:
            chosen.append(runs[0])
            continue
        ranked = sorted(runs, key=lambda c: c["cycles_per_s"])
        median = dict(ranked[(len(ranked) - 1) // 2])
        median["runs"] = len(runs)
        median["cycles_per_s_runs"] = [c["cycles_per_s"] for c in ranked]
        chosen.append(median)
    return chosen
