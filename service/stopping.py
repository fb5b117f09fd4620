"""The pause between the passes of a background loop (the reaper, the outage beacon), cut short by its
stop event.

``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11 a cancellation that lands as
``wait_for``'s timeout expires can be swallowed, and the loop would then run on after it was cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib


async def pause_unless_stopped(stop: asyncio.Event, seconds: float) -> None:
    """Return after ``seconds``, or as soon as ``stop`` is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()
