"""Batcher statistics: an accumulator the batcher feeds once per batch, and the
immutable ``BatchStats`` snapshot it hands out.

Two numbers must be read together (see the reference design): ``utilization`` (how
much of the wall time the model call runs) and ``avg_fill`` (how full the batches
are). A batcher fed one record at a time is ~100% utilized and ~0% full.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class WindowStats:
    """The same figures over the last ``batches`` batches: current health, not
    lifetime averages (a worker that was starved an hour ago looks fine now)."""

    batches: int
    records: int
    failed: int
    wall_time_s: float
    busy_time_s: float
    utilization: float
    avg_batch_size: float
    avg_batch_cost: float
    avg_fill: float
    over_budget_batches: int
    records_per_s: float


@dataclass(frozen=True, slots=True)
class BatchStats:
    """A snapshot of a batcher's counters, taken when ``batcher.stats`` is read.

    ``total_completed`` counts records resolved with a result, ``total_failed``
    records resolved with an exception (batch-level or per item), ``total_cancelled``
    records whose future the caller cancelled before they reached the model.
    ``utilization`` is busy time over wall time since ``start()`` (until ``stop()``).
    """

    target_batch_cost: float
    max_batch_size: int
    total_submitted: int
    total_completed: int
    total_failed: int
    total_cancelled: int
    total_batches: int
    over_budget_batches: int
    queue_depth: int
    wall_time_s: float
    busy_time_s: float
    idle_time_s: float
    utilization: float
    avg_batch_size: float
    avg_batch_cost: float
    avg_fill: float
    records_per_s: float
    recent: WindowStats

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, for a worker's ``/stats`` endpoint or Dagster metadata."""
        return asdict(self)


class StatsRecorder:
    """Mutable counters owned by one batcher; O(1) work per batch."""

    __slots__ = (
        "target", "max_batch_size", "completed", "failed",
        "batches", "over_budget", "cost_sum", "busy_s", "started_at", "stopped_at", "window",
    )

    def __init__(self, target: float, max_batch_size: int, window: int) -> None:
        self.target = target
        self.max_batch_size = max_batch_size
        self.completed = 0
        self.failed = 0
        self.batches = 0
        self.over_budget = 0
        self.cost_sum = 0.0
        self.busy_s = 0.0
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        # (start, end, size, cost, failed) per batch
        self.window: deque[tuple[float, float, int, float, int]] = deque(maxlen=max(1, window))

    def record_batch(self, start: float, end: float, size: int, cost: float, failed: int) -> None:
        self.batches += 1
        self.completed += size - failed
        self.failed += failed
        self.cost_sum += cost
        self.busy_s += end - start
        if cost > self.target:
            self.over_budget += 1
        self.window.append((start, end, size, cost, failed))

    def snapshot(self, queue_depth: int, submitted: int, rejected: int, cancelled: int) -> BatchStats:
        """``rejected``: records failed before batching (over a strict budget alone)."""
        now = time.perf_counter()
        if self.started_at is None:
            wall = 0.0
        else:
            wall = (self.stopped_at if self.stopped_at is not None else now) - self.started_at
        n = self.batches
        avg_cost = self.cost_sum / n if n else 0.0
        failed = self.failed + rejected
        done = self.completed + self.failed
        return BatchStats(
            target_batch_cost=self.target,
            max_batch_size=self.max_batch_size,
            total_submitted=submitted,
            total_completed=self.completed,
            total_failed=failed,
            total_cancelled=cancelled,
            total_batches=n,
            over_budget_batches=self.over_budget,
            queue_depth=queue_depth,
            wall_time_s=wall,
            busy_time_s=self.busy_s,
            idle_time_s=max(0.0, wall - self.busy_s),
            utilization=min(1.0, self.busy_s / wall) if wall > 0 else 0.0,
            avg_batch_size=done / n if n else 0.0,
            avg_batch_cost=avg_cost,
            avg_fill=avg_cost / self.target if self.target else 0.0,
            records_per_s=done / wall if wall > 0 else 0.0,
            recent=self._window_stats(now),
        )

    def _window_stats(self, now: float) -> WindowStats:
        w = self.window
        if not w:
            return WindowStats(0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0)
        end = self.stopped_at if self.stopped_at is not None else now
        wall = max(end - w[0][0], 1e-12)
        n = len(w)
        busy = sum(e - s for s, e, _, _, _ in w)
        records = sum(size for _, _, size, _, _ in w)
        cost = sum(c for _, _, _, c, _ in w)
        avg_cost = cost / n
        return WindowStats(
            batches=n,
            records=records,
            failed=sum(f for _, _, _, _, f in w),
            wall_time_s=wall,
            busy_time_s=busy,
            utilization=min(1.0, busy / wall),
            avg_batch_size=records / n,
            avg_batch_cost=avg_cost,
            avg_fill=avg_cost / self.target if self.target else 0.0,
            over_budget_batches=sum(1 for _, _, _, c, _ in w if c > self.target),
            records_per_s=records / wall,
        )
