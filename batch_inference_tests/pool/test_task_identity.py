"""A worker answers a finished task from memory only while its outputs exist, and a task id
sent again with another spec is a ``TaskConflict`` for the user, never a ``TaskFailed``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batch_inference.pool import InferConfig, PoolClient, SamplingConfig, TaskConflict, TaskFailed
from batch_inference_tests.fixtures.pool import infer_spec, read_rows, write_shard


async def test_a_finished_task_is_replayed_only_while_its_outputs_exist(tmp_path: Path, inprocess_pool: Any) -> None:
    write_shard(tmp_path / "in.jsonl", 20)
    out = tmp_path / "out.jsonl"
    spec = infer_spec("run/abc/r00/infer/00000", tmp_path / "in.jsonl", out)
    async with inprocess_pool(concurrency=2) as pool:
        first = await pool.run_task(spec)
        again = await pool.run_task(spec)
        assert not first.cached and again.cached  # the outputs are there: a replay
        out.unlink()  # the run's output deleted (a wiped folder, a re-created bucket)
        third = await pool.run_task(spec)
        assert not third.cached and len(read_rows(out)) == 20  # ran again and wrote them
        assert pool.runtime.counters["completed"] == 2 and pool.runtime.counters["cached"] == 1


async def test_a_judge_task_is_rerun_when_one_of_its_outputs_is_gone(tmp_path: Path, inprocess_pool: Any) -> None:
    from batch_inference.judges import JudgeConfig
    from batch_inference.pool import TaskSpec

    write_shard(tmp_path / "in.jsonl", 10, result="APPROVED yes", error=None)
    approved, rejected = tmp_path / "approved.jsonl", tmp_path / "rejected.jsonl"
    spec = TaskSpec(task_id="run/abc/r00/judge/00000", kind="judge", input_url=str(tmp_path / "in.jsonl"),
                    outputs={"approved": str(approved), "rejected": str(rejected)},
                    judge=JudgeConfig(kind="rule", callable="regex", kwargs={"pattern": "^APPROVED"}))
    async with inprocess_pool() as pool:
        assert not (await pool.run_task(spec)).cached
        assert rejected.exists() and read_rows(rejected) == []  # an empty output is still an output
        assert (await pool.run_task(spec)).cached
        rejected.unlink()
        assert not (await pool.run_task(spec)).cached and rejected.exists()


async def test_inprocess_spec_conflict_is_a_task_conflict_not_a_failure(tmp_path: Path, inprocess_pool: Any) -> None:
    write_shard(tmp_path / "in.jsonl", 5)
    spec = infer_spec("run/abc/r00/infer/00000", tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    edited = spec.model_copy(update={"infer": InferConfig(template="Reply: {q}", sampling=SamplingConfig(max_tokens=16))})
    async with inprocess_pool(retries=2) as pool:
        await pool.run_task(spec)
        with pytest.raises(TaskConflict, match="different spec") as info:
            await pool.run_task(edited)
        assert not isinstance(info.value, TaskFailed) and info.value.spec == edited
        assert "spec changed" in str(info.value) and pool.retried == 0


async def test_http_spec_conflict_is_a_task_conflict_not_a_failure(tmp_path: Path, worker_process: Any) -> None:
    write_shard(tmp_path / "in.jsonl", 5)
    _, endpoint, _ = worker_process()
    spec = infer_spec("run/abc/r00/infer/00000", tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    edited = spec.model_copy(update={"infer": InferConfig(template="Reply: {q}", sampling=SamplingConfig(max_tokens=16))})
    async with PoolClient([endpoint], concurrency=2, retries=2, backoff_s=0.01) as client:
        await client.run_task(spec)
        with pytest.raises(TaskConflict, match="HTTP 409") as info:
            await client.run_task(edited)
        assert not isinstance(info.value, TaskFailed) and client.retried == 0
