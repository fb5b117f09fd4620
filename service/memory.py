"""Giving freed memory back to the operating system after a burst.

A burst of short-lived buffers (change-feed readers cut by the write deadline, each with a queue of
events) is garbage once they end, but glibc keeps the freed pages of its heaps resident, so the process's
RSS stays at the burst's high-water mark. glibc's ``malloc_trim`` returns them. It walks the heaps, so it
runs in a worker thread, one at a time (a request during a trim makes one more after it), and only where
glibc is the C library.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

import structlog

log = structlog.get_logger("lockledger.memory")


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None
    return trim


class MemoryTrimmer:
    """``trim_soon()`` after a burst ends; the trims themselves never run on the event loop."""

    def __init__(self, malloc_trim: Callable[[int], int] | None = None) -> None:
        self._malloc_trim = malloc_trim if malloc_trim is not None else _glibc_malloc_trim()
        self._running: asyncio.Task[None] | None = None
        self._again = False
        self.trims = 0

    def trim_soon(self) -> None:
        if self._malloc_trim is None:
            return
        if self._running is not None and not self._running.done():
            self._again = True
            return
        self._running = asyncio.get_running_loop().create_task(self._trim())

    async def _trim(self) -> None:
        assert self._malloc_trim is not None
        while True:
            self._again = False
            try:
                await asyncio.to_thread(self._malloc_trim, 0)
            except Exception as error:  # housekeeping: a failure must not reach a request
                log.warning("malloc_trim failed", error=repr(error))
                return
            self.trims += 1
            if not self._again:
                return
