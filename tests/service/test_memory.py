"""The memory trimmer: trims off the event loop, one at a time, and once more for a request made during a
trim (a burst of readers ending at once makes two trims, not twenty, and none is lost)."""

from __future__ import annotations

import asyncio
import threading

from service.memory import MemoryTrimmer


async def test_requests_during_a_trim_make_one_more_after_it() -> None:
    started, release = threading.Event(), threading.Event()
    threads: list[int] = []

    def slow_trim(pad: int) -> int:
        threads.append(threading.get_ident())
        started.set()
        release.wait(10)
        return 1

    trimmer = MemoryTrimmer(slow_trim)
    trimmer.trim_soon()
    await asyncio.to_thread(started.wait, 10)
    for _ in range(20):  # the rest of the burst, while the first trim runs
        trimmer.trim_soon()
    release.set()
    for _ in range(1000):  # bounded: the second trim follows at once
        if trimmer.trims == 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # and no third comes
    assert trimmer.trims == 2
    assert threading.get_ident() not in threads  # never on the event loop's thread


async def test_a_failing_trim_is_logged_not_raised() -> None:
    def broken(pad: int) -> int:
        raise OSError("no heap")

    trimmer = MemoryTrimmer(broken)
    trimmer.trim_soon()
    await asyncio.sleep(0.1)
    assert trimmer.trims == 0
    trimmer.trim_soon()  # and it can be asked again
    await asyncio.sleep(0.1)
    assert trimmer.trims == 0


async def test_on_this_machine_glibc_trims() -> None:
    trimmer = MemoryTrimmer()
    trimmer.trim_soon()
    for _ in range(500):
        if trimmer.trims:
            break
        await asyncio.sleep(0.01)
    assert trimmer.trims == 1
