"""Per-record loops on a worker's event loop, cut into slices that give the loop back.

A shard task's chunk is thousands of records. Building their requests, launching them and
reading their results in one stretch held the worker's event loop for 20-80 ms at a time
(bench/gpu_speed.py on the 1B profile: 14 stretches over 10 ms a run, 0.7 s in all). That
loop also drives the engine (vLLM's output handler, the simulated engine's steps): each
stretch is time a finished request is not answered and its slot not refilled. Giving the
loop back every ``SLICE`` records keeps a stretch near a millisecond, for ~10 µs a slice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

SLICE = 128  # records a stretch: ~0.3-1 ms of request building or row writing


async def give_way(done: int) -> None:
    """Yield to the event loop once every ``SLICE`` records (``done``: records handled so far)."""
    if done % SLICE == 0 and done:
        await asyncio.sleep(0)


async def map_sliced(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, yielding to the event loop between slices."""
    out: list[R] = []
    for start in range(0, len(items), SLICE):
        if start:
            await asyncio.sleep(0)
        out.extend(fn(x) for x in items[start:start + SLICE])
    return out
