"""Retry tasks whose judge has its own model: each wave is judged on the judge pool.

The infer engine never approves as a judge (approval 0) and the judge engine always does
(approval 1), so where a verdict came from shows in the verdict itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batch_inference.judges import JudgeConfig
from batch_inference.pool import InferConfig, SamplingConfig, TaskFailed, TaskSpec
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT
from batch_inference.storage import CheckpointStore, JsonlFile
from batch_inference_tests.fixtures.pool import read_rows, write_shard


def sim(approval: float, seed: int = 0) -> dict[str, Any]:
    return {"kind": "simulated", "seed": seed,
            "simulated": {"latency_a_s": 0.0, "latency_b_s": 0.0, "approval_rate": approval}}


NEVER, ALWAYS = sim(0.0), sim(1.0, seed=1)
INFER = InferConfig(template="Answer: {q}", sampling=SamplingConfig(max_tokens=8, temperature=1.0, seed=3))
JUDGE = JudgeConfig(kind="llm", template="Judge this answer: {result}")


def retry_spec(tmp_path: Path, *, judge_pool: bool, task_id: str = "run/r00/retry/0", **kw: Any) -> TaskSpec:
    outputs = {"output": str(tmp_path / "out.jsonl.zst"), "checkpoint": str(tmp_path / "ckpt")}
    if judge_pool:
        outputs[JUDGE_POOL_OUTPUT] = str(tmp_path / "judge-waves")
    return TaskSpec(task_id=task_id, kind="retry", input_url=str(tmp_path / "in.jsonl.zst"), outputs=outputs,
                    infer=INFER, judge=kw.pop("judge", JUDGE), max_attempts=3, chunk_size=kw.pop("chunk_size", 16), **kw)


async def test_a_retry_task_judges_each_wave_on_the_judge_pool(tmp_path: Path, inprocess_pool) -> None:
    ids = write_shard(tmp_path / "in.jsonl.zst", 40)
    async with inprocess_pool(ALWAYS, concurrency=2) as judge, inprocess_pool(NEVER, concurrency=2, judge_runner=judge) as infer:
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=True))
        judged = await judge.stats()
        own = await infer.stats()
    rows = read_rows(tmp_path / "out.jsonl.zst")
    assert [r["id"] for r in rows] == ids
    # approved at the first attempt: only the judge's own model approves
    assert result.counts["approved"] == 40 and all(r["status"] == "approved" and r["attempts"] == 1 for r in rows)
    assert all(r["verdict"]["reason"] == "judge_approved" for r in rows)
    assert judged["tasks_completed"] == 3  # one judge task per wave: 40 records in chunks of 16
    assert judged["records_done"] == 40 and own["records_done"] == 40
    assert result.tokens_out > sum(len(r["result"].split()) for r in rows)  # the judge's replies count too
    assert not any((tmp_path / "judge-waves").iterdir())  # the waves' scratch shards are removed


async def test_without_the_judge_pool_output_the_task_judges_on_its_own_engine(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "in.jsonl.zst", 10)
    async with inprocess_pool(ALWAYS) as judge, inprocess_pool(NEVER, judge_runner=judge) as infer:
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=False))
        assert (await judge.stats())["tasks_completed"] == 0
    assert result.counts == {"approved": 0, "max_attempts": 10, "error": 0}


async def test_a_worker_without_a_judge_pool_refuses_the_task_naming_why(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "in.jsonl.zst", 4)
    async with inprocess_pool(NEVER) as infer:
        with pytest.raises(TaskFailed, match="this worker has none .*--judge-endpoint"):
            await infer.run_task(retry_spec(tmp_path, judge_pool=True))


async def test_a_failing_judge_pool_fails_the_task_not_its_records(tmp_path: Path, inprocess_pool) -> None:
    """A wave the judge pool cannot judge fails the retry task (the pool retries it, then
    the shard is quarantined): no record is written as an error, and the checkpoints keep
    the inferred results, so a retried task judges them without inferring them again."""
    ids = write_shard(tmp_path / "in.jsonl.zst", 6)
    async with inprocess_pool(ALWAYS) as judge, inprocess_pool(NEVER, judge_runner=judge) as infer:
        real = judge.run_task

        async def down(spec: TaskSpec) -> Any:
            raise TaskFailed(spec, ["judge pool unreachable"])

        judge.run_task = down  # type: ignore[method-assign]
        with pytest.raises(TaskFailed, match="judge pool failed a wave of 6.*judge pool unreachable"):
            await infer.run_task(retry_spec(tmp_path, judge_pool=True))
        assert not JsonlFile(str(tmp_path / "out.jsonl.zst")).exists_sync()
        states = await CheckpointStore(str(tmp_path / "ckpt")).load()
        assert sorted(states) == ids and all(s["last_result"] for s in states.values())
        judge.run_task = real  # type: ignore[method-assign]
        calls = infer.host.engine.calls
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=True, task_id="run/r00/retry/0-again"))
        assert infer.host.engine.calls == calls  # judged from the checkpoint, not inferred again
    assert result.counts["approved"] == 6


async def test_the_tail_generates_on_the_infer_pool_while_the_judge_pool_judges(tmp_path: Path, inprocess_pool) -> None:
    """The two pools work at once: the judge pool is sent a chunk's wave while the task's
    next chunk is in the infer engine. The first judge request is held until the infer
    engine has one outstanding (bounded): were the task to take turns (judge a chunk, then
    generate), none could arrive, and the hold would run out."""
    import asyncio

    ids = write_shard(tmp_path / "in.jsonl.zst", 48)
    half = sim(0.5, seed=1)  # the judge rejects some: the groups go round more than once
    async with inprocess_pool(half, concurrency=2) as judge, inprocess_pool(NEVER, concurrency=2, judge_runner=judge) as infer:
        outstanding = 0
        arrived = asyncio.Event()
        submit = infer.host.submit

        async def counting_submit(requests: list[Any], **kw: Any) -> list[asyncio.Future[Any]]:
            nonlocal outstanding
            futures = await submit(requests, **kw)
            outstanding += len(futures)
            arrived.set()

            def done(_: asyncio.Future[Any]) -> None:
                nonlocal outstanding
                outstanding -= 1

            for f in futures:
                f.add_done_callback(done)
            return futures

        infer.host.submit = counting_submit  # type: ignore[method-assign]
        run_judge = judge.run_task
        seen: list[tuple[int, int]] = []  # (rows in the wave, infer requests outstanding while it was held)

        async def held_judge(spec: TaskSpec) -> Any:
            if not seen and outstanding == 0:
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), timeout=10.0)
                except TimeoutError:
                    pass
            rows = len(read_rows(Path(spec.input_url)))
            seen.append((rows, outstanding))
            return await run_judge(spec)

        judge.run_task = held_judge  # type: ignore[method-assign]
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=True, chunk_size=16))
    rows = read_rows(tmp_path / "out.jsonl.zst")
    # exactly once each, as without the overlap
    assert [r["id"] for r in rows] == ids and sum(result.counts.values()) == 48  # in input order
    assert all(r["status"] in ("approved", "max_attempts") and 1 <= r["attempts"] <= 3 for r in rows)
    assert seen[0][0] == 16  # the first chunk's wave, whole
    assert seen[0][1] > 0, seen  # ... went to the judge while the second chunk was generating
    assert sum(n for n, _ in seen) == sum(r["attempts"] for r in rows if r["status"] == "approved") + sum(
        3 for r in rows if r["status"] == "max_attempts")  # every attempt judged once, never twice
