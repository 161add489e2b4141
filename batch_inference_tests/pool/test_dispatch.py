"""dispatch_bounded: limit, exactly-once outcomes, propagation with straggler cancellation, lazy source."""

from __future__ import annotations

import asyncio

import pytest

from batch_inference.pool import dispatch_bounded


class Gauge:
    """Tracks how many tasks are running at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    async def run(self, item: int, delay: float = 0.005) -> int:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(delay * (1 + item % 3))
            return item
        finally:
            self.now -= 1


async def test_limit_respected_and_every_result_delivered_once() -> None:
    gauge, results = Gauge(), []
    n = await dispatch_bounded(range(50), gauge.run, results.append, limit=4)
    assert n == 50
    assert gauge.peak == 4
    assert sorted(results) == list(range(50))


async def test_each_outcome_exactly_once_with_on_error() -> None:
    results: list[int] = []
    errors: list[tuple[int, str]] = []

    async def task(i: int) -> int:
        await asyncio.sleep(0.001 * (i % 4))
        if i % 5 == 0:
            raise ValueError(f"bad {i}")
        return i

    async def on_error(item: int, exc: BaseException) -> None:
        errors.append((item, str(exc)))

    await dispatch_bounded(range(40), task, results.append, on_error, limit=6)
    assert sorted(results) == [i for i in range(40) if i % 5]
    assert sorted(errors) == [(i, f"bad {i}") for i in range(0, 40, 5)]


async def test_sync_raise_in_task_fn_fails_only_that_item() -> None:
    errors: list[int] = []

    def task(i: int):  # raises before returning an awaitable
        if i == 2:
            raise KeyError(i)
        return asyncio.sleep(0, i)

    results: list[int] = []
    await dispatch_bounded([1, 2, 3], task, results.append, lambda item, exc: errors.append(item), limit=2)
    assert sorted(results) == [1, 3] and errors == [2]


async def test_without_on_error_first_failure_propagates_and_stragglers_are_cancelled_and_awaited() -> None:
    started: list[int] = []
    cancelled: list[int] = []
    finished: list[int] = []

    async def task(i: int) -> int:
        started.append(i)
        if i == 3:
            await asyncio.sleep(0.01)
            raise RuntimeError("boom")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # cleanup that must complete before we return
            cancelled.append(i)
            raise
        finished.append(i)
        return i

    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(dispatch_bounded(range(100), task, lambda r: None, limit=5), 5)
    assert sorted(started) == [0, 1, 2, 3, 4]  # nothing pulled past the limit
    assert sorted(cancelled) == [0, 1, 2, 4]  # cancelled AND awaited before the raise
    assert finished == []


async def test_async_source_is_consumed_lazily() -> None:
    pulled: list[int] = []
    release = asyncio.Event()

    async def source():
        for i in range(20):
            pulled.append(i)
            yield i

    async def task(i: int) -> int:
        await release.wait()
        return i

    results: list[int] = []
    run = asyncio.create_task(dispatch_bounded(source(), task, results.append, limit=3))
    await asyncio.sleep(0.05)
    assert pulled == [0, 1, 2]  # the producer stalls while the pool is full: backpressure
    release.set()
    assert await asyncio.wait_for(run, 5) == 20
    assert sorted(results) == list(range(20))


async def test_source_error_propagates_and_cancels_in_flight() -> None:
    cancelled: list[int] = []

    async def source():
        yield 1
        yield 2
        await asyncio.sleep(0.01)  # let both tasks start
        raise OSError("listing failed")

    async def task(i: int) -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    with pytest.raises(OSError, match="listing failed"):
        await asyncio.wait_for(dispatch_bounded(source(), task, lambda r: None, lambda i, e: None, limit=5), 5)
    assert sorted(cancelled) == [1, 2]


async def test_on_result_error_propagates() -> None:
    def on_result(r: int) -> None:
        raise ValueError("sink full")

    with pytest.raises(ValueError, match="sink full"):
        await dispatch_bounded([1, 2], lambda i: asyncio.sleep(0, i), on_result, limit=1)


async def test_rejects_non_positive_limit() -> None:
    with pytest.raises(ValueError, match="limit"):
        await dispatch_bounded([1], lambda i: asyncio.sleep(0, i), print, limit=0)
