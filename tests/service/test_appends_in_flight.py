"""A command waits for the appends in flight on its resource, and only on its resource."""

from __future__ import annotations

import asyncio
import contextlib

from service.appends_in_flight import AppendsInFlight


async def test_nothing_in_flight_means_no_wait() -> None:
    appends = AppendsInFlight()
    assert not appends.busy("zone:A3")
    await asyncio.wait_for(appends.settled("zone:A3"), timeout=0.1)


async def test_a_command_waits_for_every_append_on_its_resource_and_no_other() -> None:
    appends = AppendsInFlight()
    appends.begin("zone:A3")
    appends.begin("zone:A3")
    appends.begin("zone:B1")
    waiter = asyncio.create_task(appends.settled("zone:A3"))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    appends.end("zone:A3")
    await asyncio.sleep(0.01)
    assert not waiter.done()  # one append on zone:A3 is still in flight
    appends.end("zone:A3")
    await asyncio.wait_for(waiter, timeout=0.1)
    assert appends.busy("zone:B1")  # zone:B1's append never held zone:A3's command back
    assert len(appends) == 1
    appends.end("zone:B1")
    assert len(appends) == 0


async def test_a_waiter_woken_by_a_new_append_waits_again() -> None:
    """When several commands wait, the first one woken may append at once: the others wait for that."""
    appends = AppendsInFlight()
    appends.begin("r")
    order: list[str] = []

    async def command(name: str, appends_too: bool) -> None:
        await appends.settled("r")
        order.append(name)
        if appends_too:
            appends.begin("r")
            await asyncio.sleep(0.02)
            appends.end("r")

    first = asyncio.create_task(command("first", appends_too=True))
    second = asyncio.create_task(command("second", appends_too=False))
    await asyncio.sleep(0.01)
    appends.end("r")
    await asyncio.wait_for(asyncio.gather(first, second), timeout=1)
    assert order == ["first", "second"]


async def test_a_cancelled_waiter_does_not_disturb_the_others() -> None:
    appends = AppendsInFlight()
    appends.begin("r")
    cancelled = asyncio.create_task(appends.settled("r"))
    patient = asyncio.create_task(appends.settled("r"))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cancelled
    appends.end("r")
    await asyncio.wait_for(patient, timeout=0.1)
