"""Admission control for a streaming engine: the worker's side of continuous batching.

With a ``StreamingEngine`` there is no batch and no barrier: every request goes into the
engine as soon as a slot is free, as its own asyncio task, and resolves its own future
the moment the engine finishes it. At most ``capacity`` requests are in flight (the
engine's own ``capacity()``: what its scheduler can hold); ``submit_many`` suspends
beyond that, which is the backpressure that reaches the producers and, through the
task slots, ``dispatch_bounded``. A cancelled future cancels its request's task, and
the engine aborts the request (nothing decodes for a caller that left).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from batch_inference.engines import Completion, EngineDeadError, StreamingEngine
from batch_inference.pool.request import GenRequest
from batch_inference.pool.slices import give_way


@dataclass(frozen=True, slots=True)
class StreamStats:
    """A snapshot of the gate's counters (the streaming counterpart of ``BatchStats``).

    ``utilization`` is the fraction of wall time with at least one request in the
    engine; ``avg_fill`` is the mean of in-flight / capacity, time-weighted over the
    wall: 1.0 means the engine was offered all it can hold the whole time. Neither says
    how fast the engine ran: output tokens/s and the engine's occupancy do.
    """

    capacity: int
    in_flight: int
    peak_in_flight: int
    total_submitted: int
    total_completed: int
    total_failed: int
    total_cancelled: int
    output_tokens: int
    wall_time_s: float
    busy_time_s: float
    utilization: float
    avg_fill: float
    records_per_s: float
    output_tokens_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StreamGate:
    """At most ``capacity`` requests in a streaming engine; each resolves on its own."""

    def __init__(self, engine: StreamingEngine, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self._slots = asyncio.Semaphore(capacity)
        self._tasks: set[asyncio.Task[Completion]] = set()
        self.dead: EngineDeadError | None = None
        self.in_flight = 0
        self.peak_in_flight = 0
        self.submitted = self.completed = self.failed = self.cancelled = 0
        self.output_tokens = 0
        self.busy_s = 0.0
        self._fill_integral = 0.0  # integral of in_flight dt
        # Processor-sharing clock: advances dt / in_flight while requests run, so a
        # request's engine time is its fair share and the shares sum to busy_s.
        self._share_clock = 0.0
        self.started_at = time.perf_counter()
        self._last = self.started_at

    def _tick(self) -> None:
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        if self.in_flight:
            self.busy_s += dt
            self._fill_integral += dt * self.in_flight
            self._share_clock += dt / self.in_flight

    async def submit_many(self, requests: Sequence[GenRequest]) -> list[asyncio.Future[Completion]]:
        """One future per request, each created once a slot is free (suspends while full)."""
        futures: list[asyncio.Future[Completion]] = []
        try:
            for request in requests:
                await give_way(len(futures))  # a chunk's launches in slices: the engine's outputs get their turn
                await self._slots.acquire()
                if self.dead is not None:
                    self._slots.release()
                    raise self.dead
                futures.append(self._launch(request))
        except BaseException:
            for f in futures:  # a producer cancelled mid-submit leaves nothing running
                f.cancel()
            raise
        return futures

    def _launch(self, request: GenRequest) -> asyncio.Task[Completion]:
        self._tick()
        self.in_flight += 1
        self.submitted += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        request.fill = self.in_flight / self.capacity
        start = self._share_clock
        task = asyncio.create_task(self.engine.complete(request.prompt, request.params))
        self._tasks.add(task)

        def done(t: asyncio.Task[Completion]) -> None:
            self._tick()
            request.engine_s = self._share_clock - start
            self.in_flight -= 1
            self._tasks.discard(t)
            self._slots.release()
            if t.cancelled():
                self.cancelled += 1
                return
            exc = t.exception()
            if isinstance(exc, EngineDeadError):
                self.dead = self.dead or exc
            if exc is not None or t.result().error is not None:
                self.failed += 1
            else:
                self.completed += 1
                self.output_tokens += t.result().completion_tokens

        task.add_done_callback(done)
        return task

    async def stop(self) -> None:
        """Cancel whatever is still in flight (each request is aborted in the engine)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def stats(self) -> StreamStats:
        self._tick()
        wall = max(self._last - self.started_at, 1e-9)
        return StreamStats(
            capacity=self.capacity, in_flight=self.in_flight, peak_in_flight=self.peak_in_flight,
            total_submitted=self.submitted, total_completed=self.completed, total_failed=self.failed,
            total_cancelled=self.cancelled, output_tokens=self.output_tokens, wall_time_s=wall,
            busy_time_s=self.busy_s, utilization=self.busy_s / wall,
            avg_fill=self._fill_integral / wall / self.capacity,
            records_per_s=(self.completed + self.failed) / wall, output_tokens_per_s=self.output_tokens / wall,
        )
