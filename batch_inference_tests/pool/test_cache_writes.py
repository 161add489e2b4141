"""The result cache's writes run behind a chunk, never in its path, and a task's result waits for them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from batch_inference.engines import SamplingParams
from batch_inference.pool.context import TaskContext
from batch_inference.pool.result_cache import ResultCache
from batch_inference.prompting import Request
from batch_inference_tests.fixtures.pool import infer_spec


class HeldWrites:
    """``ResultCache.put_many`` held until released: what each write stored, in order."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.stored: list[set[str]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        async def put_many(cache: ResultCache, entries: Any) -> None:
            await self.release.wait()
            self.stored.append(set(entries))

        monkeypatch.setattr(ResultCache, "put_many", put_many)


def greedy(*texts: str) -> list[Request]:
    return [Request(t, SamplingParams(max_tokens=4, temperature=0.0)) for t in texts]


async def test_a_chunk_is_answered_while_its_cache_write_is_held(tmp_path: Path, inprocess_pool: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldWrites()
    held.install(monkeypatch)
    async with inprocess_pool() as pool:
        ctx = TaskContext(infer_spec("t", tmp_path / "in", tmp_path / "out", result_cache=str(tmp_path / "cache")), pool.host)
        first = await asyncio.wait_for(ctx.generate(greedy("a", "b")), 30)  # before: held here with its write
        second = await asyncio.wait_for(ctx.generate(greedy("c")), 30)
        assert [c.error for c in first + second] == [None, None, None]
        settled = asyncio.ensure_future(ctx.settle_cache_writes())
        await asyncio.sleep(0.05)
        assert not settled.done() and held.stored == []  # the task's result waits for its writes
        held.release.set()
        await asyncio.wait_for(settled, 30)
        assert [len(s) for s in held.stored] == [2, 1]  # one write a chunk, in order


async def test_a_task_that_ends_early_drops_the_writes_not_begun(tmp_path: Path, inprocess_pool: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldWrites()
    held.install(monkeypatch)
    async with inprocess_pool() as pool:
        ctx = TaskContext(infer_spec("t", tmp_path / "in", tmp_path / "out", result_cache=str(tmp_path / "cache")), pool.host)
        await ctx.generate(greedy("a"))
        await asyncio.sleep(0.05)  # its write begins (held)
        await ctx.generate(greedy("b"))
        ctx.drop_cache_writes()
        held.release.set()
        with pytest.raises(asyncio.CancelledError):
            await ctx.settle_cache_writes()
        await asyncio.sleep(0.05)
        assert [len(s) for s in held.stored] == [1]  # the first chunk's write had begun: it ends; the second's never runs


async def test_a_finished_tasks_results_are_in_the_cache(tmp_path: Path, inprocess_pool: Any) -> None:
    from batch_inference.pool import InferConfig, SamplingConfig
    from batch_inference.storage import JsonlFile

    src = tmp_path / "in.jsonl"
    with JsonlFile(str(src)).writer_sync() as w:
        w.write_many([{"id": f"r{i}", "q": f"question {i}"} for i in range(7)])
    infer = InferConfig(template="Answer: {q}", sampling=SamplingConfig(max_tokens=4, temperature=0.0))
    spec = infer_spec("t", src, tmp_path / "out.jsonl", infer=infer, chunk_size=3, result_cache=str(tmp_path / "cache"))
    async with inprocess_pool() as pool:
        result = await pool.run_task(spec)
    assert result.records_in == 7 and result.result_cache_hits == 0
    assert ResultCache(str(tmp_path / "cache")).trim(1 << 30).entries == 7
