"""``dispatch_bounded``: the reference design's ``_dispatch_bounded``.

At most ``limit`` tasks are in flight, and the next item is pulled from ``source`` only
when a slot is free, so a slow pool stalls the producer: that stall is the whole
backpressure story. Each outcome is delivered exactly once, to ``on_result`` or
``on_error``. With ``on_error=None`` the first failure propagates after the stragglers
have been cancelled *and awaited* (nothing keeps running behind the caller's back).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_IN_FLIGHT = 320  # the reference's 32 replicas x 10 concurrency


async def _as_async_iter(source: Iterable[T] | AsyncIterable[T]) -> AsyncIterator[T]:
    if isinstance(source, AsyncIterable):
        async for item in source:
            yield item
    else:
        for item in source:
            yield item


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def dispatch_bounded(
    source: Iterable[T] | AsyncIterable[T],
    task_fn: Callable[[T], Awaitable[R]],
    on_result: Callable[[R], Any],
    on_error: Callable[[T, BaseException], Any] | None = None,
    limit: int = MAX_IN_FLIGHT,
) -> int:
    """Run ``task_fn`` over ``source`` with at most ``limit`` in flight; returns items dispatched.

    ``on_result(result)`` / ``on_error(item, exc)`` may be plain functions or coroutines.
    An exception raised by ``source``, ``on_result`` or ``on_error`` propagates the same
    way as a task failure with ``on_error=None``.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    in_flight: dict[asyncio.Task[R], T] = {}
    dispatched = 0

    async def run(item: T) -> R:
        return await task_fn(item)  # a task_fn that raises on call fails only its item

    async def reap() -> None:
        done, _ = await asyncio.wait(in_flight.keys(), return_when=asyncio.FIRST_COMPLETED)
        first_error: BaseException | None = None
        for task in done:
            item = in_flight.pop(task)
            if task.cancelled():
                exc: BaseException | None = asyncio.CancelledError(f"task for {item!r} was cancelled")
            else:
                exc = task.exception()
            if exc is None:
                await _maybe_await(on_result(task.result()))
            elif on_error is None:
                first_error = first_error or exc  # deliver this batch's successes first
            else:
                await _maybe_await(on_error(item, exc))
        if first_error is not None:
            raise first_error

    items = _as_async_iter(source)
    try:
        while True:
            while len(in_flight) >= limit:
                await reap()
            try:
                item = await anext(items)
            except StopAsyncIteration:
                break
            in_flight[asyncio.create_task(run(item))] = item
            dispatched += 1
        while in_flight:
            await reap()
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
        await items.aclose()
    return dispatched
