"""How late the event loop runs what is ready to run: a server's saturation as an operator sees it.

One process serves every request on one event loop. When it has more ready work than it can run, each
request waits its turn between the database's answer and the response, and that wait is invisible in the
database's timings. A watcher that asks to wake every ``interval_s`` and notes how late it woke measures
that wait directly (to the millisecond, the resolution of the loop's timers), for about a microsecond of
work per wake-up.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

LOOP_LAG = Histogram(
    "lockledger_event_loop_lag_seconds",
    "How late the event loop ran a callback that was due (sampled every 100 ms)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)


async def watch(interval_s: float = 0.1, lag: Histogram = LOOP_LAG) -> None:
    """Observe the loop's lateness until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag.observe(max(0.0, loop.time() - due))
