"""Fault 5: requests duplicated and delayed, as by a network that retransmits and reorders.

Half of all requests are sent a second time under the same Idempotency-Key a few milliseconds later
(two in flight at once), and a third of them once more up to 2 s later, when the lock may long have
changed hands. Each command must still be applied at most once: a late copy of an acquire, renew or
release that was applied gets the stored answer again (``Idempotent-Replayed``), never a new event.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest

from tests.faults.history import History, Operation
from tests.faults.load import LATE_COPY, MIN_ACKED, Load, LoadProfile
from tests.faults.processes import ServerFactory
from tests.faults.report import conclude

pytestmark = [pytest.mark.storage, pytest.mark.slow]

PROFILE = LoadProfile(clients=24, duplicate=0.5, late_duplicate=0.3, late_delay_s=(0.3, 2.0))
LOAD_S = 5.0


def _late_grants(history: History) -> int:
    """Acquires refused at first and then granted to a copy sent after that refusal was answered:
    rejections are not stored (docs/semantics.md), so a late copy is decided afresh and may take a lock
    its sender has given up on; the lease then idles until its deadline."""
    by_key: dict[str, list[Operation]] = defaultdict(list)
    for op in history.operations:
        if op.command == "acquire":
            by_key[op.key].append(op)
    late = 0
    for ops in by_key.values():
        refusals = [op.completed_mono for op in ops if op.failed and op.completed_mono is not None]
        late += bool(refusals) and any(
            op.ok and not op.replayed and op.invoked_mono > min(refusals) for op in ops
        )
    return late


async def test_duplicated_and_delayed_requests(
    database_url: str, unique_prefix: str, start_server: ServerFactory
) -> None:
    started = time.monotonic()
    history = History()
    server = start_server(database_url)
    resources = [f"{unique_prefix}pallet{i}" for i in range(12)]
    async with Load(server.base_url, resources, history, PROFILE, seed=5):
        await asyncio.sleep(LOAD_S)

    copies = [op for op in history.operations if op.copy > 0]
    replayed_copies = [op for op in copies if op.replayed]
    late_replays = [op for op in replayed_copies if op.copy == LATE_COPY]
    audit = await conclude(
        "duplicated and delayed requests",
        database_url,
        unique_prefix,
        history,
        started,
        copies=len(copies),
        replayed_copies=len(replayed_copies),
        replayed_late_copies=len(late_replays),
        late_copy_took_lock=_late_grants(history),
    )
    assert audit.violations == [], "\n".join(map(str, audit.violations))
    assert len(history.acked) > MIN_ACKED, "the load never got going"
    assert len(copies) > MIN_ACKED, "too few duplicates to mean anything"
    assert late_replays, "no late duplicate was answered from the idempotency store"
