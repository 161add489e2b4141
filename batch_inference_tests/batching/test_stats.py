"""BatchStats: lifetime figures, the recent window, and as_dict()."""

from __future__ import annotations

import asyncio
import json

import pytest

from batch_inference.batching import BatchStats, DynamicBatcher


async def test_lifetime_and_recent_window_figures() -> None:
    async def fn(batch: list) -> list:
        await asyncio.sleep(0.02)
        return [ValueError("bad") if x == "bad" else x for x in batch]

    b = DynamicBatcher(fn, target_batch_cost=10, max_batch_size=1, batch_timeout_s=0.01,
                       prefetch_batches=1, max_queue_size=100, stats_window=2)
    assert b.stats.total_batches == 0 and b.stats.utilization == 0.0
    async with b:
        futures = await b.submit_many(["a", "b", "c", "bad", "e"], estimated_costs=[10, 10, 10, 4, 4])
        await asyncio.gather(*futures, return_exceptions=True)
        await asyncio.sleep(0.05)  # idle time accrues while running
    s = b.stats
    assert isinstance(s, BatchStats)
    assert (s.total_submitted, s.total_completed, s.total_failed, s.total_batches) == (5, 4, 1, 5)
    assert s.avg_batch_size == 1.0
    assert s.avg_batch_cost == pytest.approx(38 / 5)
    assert s.avg_fill == pytest.approx(38 / 5 / 10)
    assert s.busy_time_s >= 5 * 0.02 * 0.9
    assert s.idle_time_s >= 0.04
    assert s.busy_time_s + s.idle_time_s == pytest.approx(s.wall_time_s)
    assert 0 < s.utilization < 1 and s.utilization == pytest.approx(s.busy_time_s / s.wall_time_s)
    assert s.records_per_s == pytest.approx(5 / s.wall_time_s)
    # the window holds the last two batches only: cost 4 each, one failure
    r = s.recent
    assert (r.batches, r.records, r.failed) == (2, 2, 1)
    assert r.avg_batch_cost == 4 and r.avg_fill == pytest.approx(0.4)
    assert r.over_budget_batches == 0
    # frozen after stop: wall time no longer grows
    await asyncio.sleep(0.02)
    assert b.stats.wall_time_s == s.wall_time_s


async def test_as_dict_is_json_ready_and_complete() -> None:
    async def fn(batch: list) -> list:
        return batch

    async with DynamicBatcher(fn, target_batch_cost=4, max_batch_size=8, batch_timeout_s=0.01) as b:
        await asyncio.gather(*await b.submit_many(range(8), estimated_costs=[3] * 8))
    d = json.loads(json.dumps(b.stats.as_dict()))
    for key in ("utilization", "avg_batch_size", "avg_batch_cost", "avg_fill", "total_submitted",
                "total_completed", "total_failed", "total_batches", "busy_time_s", "idle_time_s",
                "records_per_s", "over_budget_batches"):
        assert key in d, key
    assert d["total_batches"] == 4 and d["over_budget_batches"] == 4  # 3 + 3 = 6 > 4
    assert d["recent"]["batches"] == 4 and d["recent"]["avg_batch_cost"] == 6
