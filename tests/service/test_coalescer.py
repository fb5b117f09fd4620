"""The coalescer batches what waits, keeps conflicting requests apart, and isolates failures."""

from __future__ import annotations

import asyncio

import pytest

from service.coalescer import Coalescer


class _Backend:
    def __init__(self, fail_many: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.fail_many = fail_many

    async def one(self, request: int) -> int:
        await asyncio.sleep(0.001)
        if request == 13:
            raise ValueError("unlucky")
        self.batches.append([request])
        return request * 10

    async def many(self, requests: list[int]) -> list[int]:
        await asyncio.sleep(0.001)
        if self.fail_many:
            raise RuntimeError("the whole batch failed")
        self.batches.append(list(requests))
        return [r * 10 for r in requests]


async def test_a_lone_request_goes_out_at_once_alone() -> None:
    backend = _Backend()
    coalescer: Coalescer[int, int] = Coalescer(backend.one, backend.many)
    assert await coalescer.submit(4) == 40
    assert backend.batches == [[4]]


async def test_a_lone_request_leaves_from_the_batching_task_itself() -> None:
    """No task of its own for a batch of one: every task is one more pass through a busy event loop."""
    backend = _Backend()
    tasks: list[asyncio.Task[object] | None] = []

    async def one(request: int) -> int:
        tasks.append(asyncio.current_task())
        return await backend.one(request)

    coalescer: Coalescer[int, int] = Coalescer(one, backend.many)
    assert await coalescer.submit(4) == 40
    (task,) = tasks
    assert task is not None
    assert task.get_coro().__qualname__ == "Coalescer._drain"  # type: ignore[union-attr]


async def test_concurrent_requests_share_round_trips() -> None:
    backend = _Backend()
    coalescer: Coalescer[int, int] = Coalescer(backend.one, backend.many, max_in_flight=2)
    results = await asyncio.gather(*(coalescer.submit(i) for i in range(100)))
    assert results == [i * 10 for i in range(100)]
    assert len(backend.batches) < 20  # 100 requests, at most 2 in flight: most rode along in batches
    assert sorted(r for batch in backend.batches for r in batch) == list(range(100))


async def test_requests_with_a_common_key_never_share_a_batch() -> None:
    backend = _Backend()
    coalescer: Coalescer[int, int] = Coalescer(
        backend.one, backend.many, max_in_flight=1, keys=lambda r: [r % 5]
    )
    await asyncio.gather(*(coalescer.submit(i) for i in range(50)))
    for batch in backend.batches:
        assert len({r % 5 for r in batch}) == len(batch)


async def test_a_failed_batch_is_retried_one_by_one_with_each_own_outcome() -> None:
    backend = _Backend(fail_many=True)
    coalescer: Coalescer[int, int] = Coalescer(backend.one, backend.many, max_in_flight=1)
    outcomes = await asyncio.gather(*(coalescer.submit(i) for i in range(10, 20)), return_exceptions=True)
    for request, outcome in zip(range(10, 20), outcomes, strict=True):
        if request == 13:
            assert isinstance(outcome, ValueError)
        else:
            assert outcome == request * 10
    assert all(len(batch) == 1 for batch in backend.batches)


@pytest.mark.parametrize("max_batch", [1, 3])
async def test_batches_respect_their_size_limit(max_batch: int) -> None:
    backend = _Backend()
    coalescer: Coalescer[int, int] = Coalescer(
        backend.one, backend.many, max_in_flight=1, max_batch=max_batch
    )
    await asyncio.gather(*(coalescer.submit(i) for i in range(20, 50)))
    assert max(len(batch) for batch in backend.batches) <= max_batch


async def test_an_unreachable_database_fails_the_whole_batch_at_once() -> None:
    """Retrying each request alone after a timeout would only multiply the wait."""
    backend = _Backend(fail_many=True)
    coalescer: Coalescer[int, int] = Coalescer(
        backend.one, backend.many, max_in_flight=1, retry_alone=lambda error: False
    )
    outcomes = await asyncio.gather(*(coalescer.submit(i) for i in range(20, 30)), return_exceptions=True)
    assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)
    assert backend.batches == []  # nothing was retried one by one


async def test_every_batch_is_reported_with_its_size_and_round_trip() -> None:
    """What operators read on /metrics: commands per batch and each batch's time, retries included."""
    backend = _Backend()
    reported: list[tuple[int, float]] = []
    coalescer: Coalescer[int, int] = Coalescer(
        backend.one, backend.many, max_in_flight=1, on_batch=lambda n, s: reported.append((n, s))
    )
    await asyncio.gather(*(coalescer.submit(i) for i in range(40)))
    assert [n for n, _ in reported] == [len(batch) for batch in backend.batches]
    assert sum(n for n, _ in reported) == 40
    assert all(seconds >= 0.001 for _, seconds in reported)  # each backend call sleeps 1 ms

    failing = _Backend(fail_many=True)
    reported.clear()
    coalescer = Coalescer(
        failing.one, failing.many, max_in_flight=1, on_batch=lambda n, s: reported.append((n, s))
    )
    await asyncio.gather(*(coalescer.submit(i) for i in range(20, 30)))
    # The ten waited together, failed as one batch and were retried alone (concurrently): the report
    # counts that one batch of ten, with its whole time, the failed attempt and the retries (1 ms each).
    assert [n for n, _ in reported] == [10]
    assert reported[0][1] >= 0.002


class _Lanes:
    """A backend that counts how many batches are out at once; a batch holding ``stuck`` waits for
    ``release`` (a row lock, a slow statement), every other one takes ``seconds``."""

    def __init__(self, seconds: float, stuck: int | None = None) -> None:
        self.seconds = seconds
        self.stuck = stuck
        self.release = asyncio.Event()
        self.out = 0
        self.most_out = 0
        self.batches: list[list[int]] = []

    async def _serve(self, requests: list[int]) -> list[int]:
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        try:
            if self.stuck in requests:
                await self.release.wait()
            else:
                await asyncio.sleep(self.seconds)
        finally:
            self.out -= 1
        self.batches.append(list(requests))
        return [r * 10 for r in requests]

    async def one(self, request: int) -> int:
        return (await self._serve([request]))[0]

    async def many(self, requests: list[int]) -> list[int]:
        return await self._serve(requests)


async def _trickle(coalescer: Coalescer[int, int], count: int, every_s: float) -> list[int]:
    """``count`` requests, one every ``every_s``: a moderate load, never a burst."""
    tasks = []
    for request in range(count):
        tasks.append(asyncio.create_task(coalescer.submit(request)))
        await asyncio.sleep(every_s)
    return list(await asyncio.gather(*tasks))


async def test_while_batches_come_back_on_time_one_is_out_and_arrivals_ride_the_next() -> None:
    """At a moderate load (a request every 2 ms, round trips of 10 ms) the requests do not go out one
    per round trip into spare lanes: one batch is out at a time, and those that arrived meanwhile
    leave together."""
    backend = _Lanes(seconds=0.01)
    # Late only past ten round trips, so a slow test machine cannot make a batch late here.
    coalescer: Coalescer[int, int] = Coalescer(backend.one, backend.many, max_in_flight=4, late_factor=10.0)
    await coalescer.submit(-1)  # until a round trip has been timed, any batch out 1 ms counts as late
    backend.batches.clear()
    assert await _trickle(coalescer, 40, 0.002) == [r * 10 for r in range(40)]
    assert backend.most_out == 1
    assert len(backend.batches) <= 15  # 40 requests over about 90 ms of 10 ms round trips
    assert sorted(r for batch in backend.batches for r in batch) == list(range(40))


async def test_every_batch_may_go_out_at_once_without_a_late_factor() -> None:
    """``late_factor=None`` (the pass-through when coalescing is off): no request waits for another's
    round trip while the cap allows, so the same trickle goes out in several lanes."""
    backend = _Lanes(seconds=0.01)
    coalescer: Coalescer[int, int] = Coalescer(backend.one, backend.many, max_in_flight=4, late_factor=None)
    await _trickle(coalescer, 40, 0.002)
    assert backend.most_out == 4
    assert len(backend.batches) > 15


async def test_a_late_batch_does_not_hold_up_the_requests_behind_it() -> None:
    """A batch stuck behind a row lock: after twice the usual round trip the next requests get a lane
    of their own and are answered while it is still out."""
    backend = _Lanes(seconds=0.002, stuck=100)
    coalescer: Coalescer[int, int] = Coalescer(backend.one, backend.many, max_in_flight=4)
    await _trickle(coalescer, 10, 0.001)  # the usual round trip: 2 ms
    stuck = asyncio.create_task(coalescer.submit(100))
    await asyncio.sleep(0.001)
    try:
        behind = await asyncio.wait_for(asyncio.gather(*(coalescer.submit(r) for r in range(200, 205))), 10)
        assert behind == [r * 10 for r in range(200, 205)]
        assert not stuck.done()  # answered while the stuck batch is still out
    finally:
        backend.release.set()
    assert await stuck == 1000


async def test_late_batches_never_exceed_the_cap() -> None:
    """However many batches are late, no more than ``max_in_flight`` are out."""
    backend = _Lanes(seconds=0.05)
    coalescer: Coalescer[int, int] = Coalescer(
        backend.one, backend.many, max_in_flight=3, min_late_s=0.001, late_factor=0.01
    )
    assert await _trickle(coalescer, 30, 0.003) == [r * 10 for r in range(30)]
    assert backend.most_out == 3
