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
