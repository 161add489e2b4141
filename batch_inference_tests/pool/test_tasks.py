"""Shard tasks through InProcessPool (the exact code a worker runs, no HTTP)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from batch_inference.judges import JudgeConfig
from batch_inference.pool import InferConfig, SamplingConfig, TaskConflict, TaskFailed, TaskSpec, derive_seed
from batch_inference.pool.runtime import Abandoned, Busy
from batch_inference.storage import CheckpointStore, JsonlFile
from batch_inference_tests.fixtures.pool import SIM_ENGINE, infer_spec, read_rows, write_shard

LLM_JUDGE = JudgeConfig(kind="llm", template="Judge this answer: {result}")

# A rule judge spy: approves only the result "SENTINEL" and records every call.
JUDGED: list[tuple[str, str]] = []
_JUDGED_LOCK = threading.Lock()


def sentinel_rule(record: dict, result: str) -> bool:
    with _JUDGED_LOCK:
        JUDGED.append((record["id"], result))
    return result == "SENTINEL"


SPY_JUDGE = JudgeConfig(kind="rule", callable=f"{__name__}:sentinel_rule")


async def test_infer_writes_one_row_per_record_with_seeded_results(tmp_path: Path, inprocess_pool) -> None:
    ids = write_shard(tmp_path / "in.jsonl.zst", 300)
    async with inprocess_pool(concurrency=2) as pool:
        r1 = await pool.run_task(infer_spec("a", tmp_path / "in.jsonl.zst", tmp_path / "a.jsonl.zst", chunk_size=64))
        r2 = await pool.run_task(infer_spec("b", tmp_path / "in.jsonl.zst", tmp_path / "b.jsonl.zst", chunk_size=300))
    rows = read_rows(tmp_path / "a.jsonl.zst")
    assert [r["id"] for r in rows] == ids
    assert r1.counts == {"ok": 300, "error": 0} and r1.records_in == 300
    assert r1.tokens_in == sum(r["usage"]["prompt_tokens"] for r in rows) > 0
    assert r1.tokens_out == sum(r["usage"]["completion_tokens"] for r in rows) > 0
    assert all(r["attempts"] == 1 and r["error"] is None and r["result"] for r in rows)
    # per-record seeds: the same output whatever the chunking and batch composition
    assert [r["result"] for r in read_rows(tmp_path / "b.jsonl.zst")] == [r["result"] for r in rows]
    assert r2.engine_busy_s > 0 and 0 < r2.avg_fill <= 1.5


def test_derive_seed_is_stable_and_varies_by_attempt() -> None:
    assert derive_seed(7, "x", 0) == derive_seed(7, "x", 0)
    assert len({derive_seed(7, "x", a) for a in range(20)}) == 20
    assert derive_seed(None, "x", 0) == derive_seed(0, "x", 0)
    assert all(0 <= derive_seed(s, str(s), s) < 2**31 for s in range(100))


async def test_bad_records_fail_alone_not_the_shard(tmp_path: Path, inprocess_pool) -> None:
    src = tmp_path / "in.jsonl"
    with JsonlFile(str(src)).writer_sync() as w:
        w.write_many([{"id": "ok1", "q": "fine"}, {"id": "p", "q": "poison pill"}, {"id": "nofield"}, {"id": "ok2", "q": "fine too"}])
    engine = {**SIM_ENGINE, "simulated": {**SIM_ENGINE["simulated"], "fail_on": "poison"}}
    async with inprocess_pool(engine, concurrency=1) as pool:
        res = await pool.run_task(infer_spec("t", src, tmp_path / "out.jsonl"))
    rows = {r["id"]: r for r in read_rows(tmp_path / "out.jsonl")}
    assert res.counts == {"ok": 2, "error": 2}
    assert rows["p"]["result"] is None and "simulated_error" in rows["p"]["error"]
    assert "missing_field" in rows["nofield"]["error"] and "{q}" in rows["nofield"]["error"]
    assert rows["ok1"]["result"] and rows["ok2"]["result"]


async def test_record_without_id_fails_the_task_with_no_output(tmp_path: Path, inprocess_pool) -> None:
    src = tmp_path / "in.jsonl"
    with JsonlFile(str(src)).writer_sync() as w:
        w.write_many([{"id": "a", "q": "x"}, {"q": "no id here"}])
    async with inprocess_pool(retries=2) as pool:
        with pytest.raises(TaskFailed, match="record 2 has no 'id'") as info:
            await pool.run_task(infer_spec("t", src, tmp_path / "out.jsonl"))
    assert len(info.value.errors) == 1  # an input error is not retried
    assert not (tmp_path / "out.jsonl").exists()


async def test_judge_splits_rows_and_accounts_for_every_record(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "in.jsonl", 200)
    engine = {**SIM_ENGINE, "simulated": {**SIM_ENGINE["simulated"], "fail_on": "r000007 "}}
    async with inprocess_pool(engine, concurrency=2) as pool:
        inferred = await pool.run_task(infer_spec("i", tmp_path / "in.jsonl", tmp_path / "inf.jsonl", round=2))
        spec = TaskSpec(task_id="j", kind="judge", input_url=str(tmp_path / "inf.jsonl"), round=2, judge=LLM_JUDGE,
                        outputs={"approved": str(tmp_path / "ok.jsonl"), "rejected": str(tmp_path / "no.jsonl")})
        judged = await pool.run_task(spec)
    approved, rejected = read_rows(tmp_path / "ok.jsonl"), read_rows(tmp_path / "no.jsonl")
    assert inferred.counts["error"] == 1
    # the simulated engine's error is permanent: rejected, and counted apart for the round's "failed"
    assert judged.counts == {"approved": len(approved), "rejected": len(rejected), "permanent_errors": 1}
    assert len(approved) + len(rejected) == 200 and 40 < len(approved) < 160  # approval_rate 0.5
    assert sorted(r["id"] for r in approved + rejected) == sorted(r["id"] for r in read_rows(tmp_path / "inf.jsonl"))
    assert all(r["status"] == "approved" and r["round"] == 2 and r["verdict"]["approved"] for r in approved)
    err = [r for r in rejected if r["id"] == "r000007"]
    assert err and err[0]["rejection"].startswith("inference_error: simulated_error") and err[0]["verdict"] is None
    assert all(r["rejection"] == "judge_rejected" for r in rejected if r["id"] != "r000007")


async def test_retry_resumes_each_record_at_its_checkpointed_attempt(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "in.jsonl", 4)  # r000000..r000003
    ckpt = str(tmp_path / "ckpt")
    done = {"result": "kept", "status": "approved", "error": None, "attempts": 2, "verdict": {"approved": True, "reason": "x", "score": None}}
    await CheckpointStore(ckpt).append([
        {"id": "r000000", "attempt": 3, "last_result": None},        # evicted at attempt 4 of 5, after a rejection
        {"id": "r000001", "attempt": 2, "last_result": "SENTINEL"},  # inferred, not yet judged
        {"id": "r000002", "attempt": 1, "last_result": None, "final": done},  # finished before the eviction
    ])
    JUDGED.clear()
    spec = TaskSpec(task_id="s2", kind="retry", input_url=str(tmp_path / "in.jsonl"), max_attempts=5, judge=SPY_JUDGE,
                    infer=InferConfig(template="{q}", sampling=SamplingConfig(temperature=1.0, seed=1)),
                    outputs={"output": str(tmp_path / "out.jsonl"), "checkpoint": ckpt})
    async with inprocess_pool() as pool:
        res = await pool.run_task(spec)
    rows = {r["id"]: r for r in read_rows(tmp_path / "out.jsonl")}
    calls = {rid: [res_ for i, res_ in JUDGED if i == rid] for rid in rows}
    assert len(calls["r000000"]) == 2 and "SENTINEL" not in calls["r000000"]  # attempts 4 and 5 only
    assert rows["r000000"]["status"] == "max_attempts" and rows["r000000"]["attempts"] == 5
    assert calls["r000001"] == ["SENTINEL"]  # judged as it was, not re-inferred
    assert rows["r000001"]["status"] == "approved" and rows["r000001"]["attempts"] == 3
    assert calls["r000002"] == [] and rows["r000002"]["result"] == "kept" and rows["r000002"]["status"] == "approved"
    assert len(calls["r000003"]) == 5 and rows["r000003"]["status"] == "max_attempts"
    assert res.counts == {"approved": 2, "max_attempts": 2, "error": 0}
    state = await CheckpointStore(ckpt).load()
    assert state["r000000"]["final"]["status"] == "max_attempts" and state["r000003"]["attempt"] == 5


@pytest.mark.parametrize("kind", ["infer", "retry"])
async def test_an_error_raised_for_a_whole_wave_fails_the_task_in_both_kinds(tmp_path: Path, inprocess_pool, kind: str) -> None:
    """The engine host raising for a wave (here its tokenizer pass) is not a record's failure:
    an infer task fails with it, and an in-place retry task the same way, writing no row
    (before, the retry task ended every record of the wave ``error`` and succeeded)."""
    write_shard(tmp_path / "in.jsonl", 8)
    spec = TaskSpec(task_id=f"wave-{kind}", kind=kind, input_url=str(tmp_path / "in.jsonl"), max_attempts=2, judge=LLM_JUDGE,
                    infer=InferConfig(template="{q}", sampling=SamplingConfig(temperature=1.0)),
                    outputs={"output": str(tmp_path / "out.jsonl"), **({"checkpoint": str(tmp_path / "ckpt")} if kind == "retry" else {})})
    async with inprocess_pool() as pool:

        async def broken_encode(prompts: list) -> list:
            raise RuntimeError("tokenizer pass failed for the batch")

        pool.host.encode = broken_encode  # type: ignore[method-assign]
        with pytest.raises(TaskFailed, match="tokenizer pass failed for the batch"):
            await pool.run_task(spec)
    assert not (tmp_path / "out.jsonl").exists()


async def test_retry_flushes_checkpoints_once_per_chunk_not_per_sample(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "in.jsonl", 30)
    ckpt = str(tmp_path / "ckpt")
    spec = TaskSpec(task_id="s2", kind="retry", input_url=str(tmp_path / "in.jsonl"), max_attempts=3, chunk_size=10,
                    judge=LLM_JUDGE, infer=InferConfig(template="{q}", sampling=SamplingConfig(temperature=1.0)),
                    outputs={"output": str(tmp_path / "out.jsonl"), "checkpoint": ckpt})
    async with inprocess_pool(checkpoint_interval_s=3600) as pool:
        res = await pool.run_task(spec)
    assert sum(res.counts.values()) == 30
    assert len(CheckpointStore(ckpt).segments()) == 3  # 3 chunks -> 3 segments, for ~60 per-attempt states
    assert len(await CheckpointStore(ckpt).load()) == 30


async def test_concurrent_tasks_share_one_batcher(tmp_path: Path, inprocess_pool) -> None:
    for s in range(8):
        write_shard(tmp_path / f"in{s}.jsonl", 20, prefix=f"s{s}-")
    async with inprocess_pool(concurrency=8, batcher={"batch_timeout_s": 0.5}) as pool:
        results = await asyncio.gather(*(pool.run_task(infer_spec(f"t{s}", tmp_path / f"in{s}.jsonl", tmp_path / f"o{s}.jsonl", chunk_size=20)) for s in range(8)))
        stats = await pool.stats()
    assert sum(r.records_in for r in results) == 160
    assert stats["engine_loads"] == 1
    assert stats["batcher"]["avg_batch_size"] > 20  # one task alone could never fill more than its 20-record chunk


async def test_idempotent_by_task_id_and_conflicting_spec_refused(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "in.jsonl", 10)
    spec = infer_spec("same", tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    async with inprocess_pool() as pool:
        first, joined = await asyncio.gather(pool.run_task(spec), pool.run_task(spec))  # the second joins the first
        again = await pool.run_task(spec)
        assert (await pool.stats())["tasks_completed"] == 1
        with pytest.raises(TaskConflict, match="different spec"):
            await pool.run_task(spec.model_copy(update={"chunk_size": 3}))
    assert not first.cached and again.cached
    assert again.model_copy(update={"cached": False}) == first == joined


async def test_busy_and_abandoned_tasks(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "a.jsonl", 400)
    write_shard(tmp_path / "b.jsonl", 5)
    slow = {**SIM_ENGINE, "simulated": {"latency_a_s": 0.05, "latency_b_s": 0.0}}
    async with inprocess_pool(slow, concurrency=1, batcher={"max_batch_size": 4}) as pool:
        runtime = pool.runtime
        long_task = asyncio.create_task(runtime.run(infer_spec("long", tmp_path / "a.jsonl", tmp_path / "a-out.jsonl", chunk_size=8)))
        await asyncio.sleep(0.2)
        with pytest.raises(Busy):
            await runtime.run(infer_spec("other", tmp_path / "b.jsonl", tmp_path / "b-out.jsonl"))
        assert await runtime.drain(grace_s=0.1) == ["long"]
        with pytest.raises(Abandoned):
            await long_task
    assert not (tmp_path / "a-out.jsonl").exists()  # abandoned inside its writer: nothing committed


async def test_storage_profiles_are_the_workers_own(tmp_path: Path, inprocess_pool) -> None:
    src = "memory://pool-test/in.jsonl"
    async with JsonlFile(src, storage_options={}).writer() as w:
        await w.write_many([{"id": "a", "q": "x"}, {"id": "b", "q": "y"}])
    spec = infer_spec("p", src, "memory://pool-test/out.jsonl", storage_options_ref="mem")
    async with inprocess_pool(storage_profiles={"mem": {}}) as pool:
        assert (await pool.run_task(spec)).counts == {"ok": 2, "error": 0}
        with pytest.raises(TaskFailed, match="unknown storage profile 'other'"):
            await pool.run_task(spec.model_copy(update={"task_id": "q", "storage_options_ref": "other"}))


async def test_a_cancelled_caller_cancels_its_task_and_the_engine_work_stops(tmp_path: Path, inprocess_pool, caplog) -> None:
    """The last caller of a task going away (a run stopped, a batch cancelled) cancels the task:
    its queued requests leave the batcher, so the engine's batches stop within one batch, its
    slot is free for the next task at once, and nothing is committed. Before, the shielded task
    ran its whole shard on (here ~5 s of batches) and held its slot meanwhile."""
    write_shard(tmp_path / "a.jsonl", 400)
    write_shard(tmp_path / "b.jsonl", 4, prefix="b")
    slow = {**SIM_ENGINE, "simulated": {"latency_a_s": 0.05, "latency_b_s": 0.0}}
    async with inprocess_pool(slow, concurrency=1, batcher={"max_batch_size": 4}) as pool:
        caller = asyncio.create_task(pool.run_task(infer_spec("long", tmp_path / "a.jsonl", tmp_path / "a-out.jsonl", chunk_size=8)))
        await asyncio.sleep(0.3)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        stats = await pool.stats()
        assert stats["tasks_running"] == 0 and stats["tasks_cancelled"] == 1 and stats["tasks_failed"] == 0
        batches = stats["batcher"]["total_batches"]
        await asyncio.sleep(0.5)  # ten batches' time
        assert (await pool.stats())["batcher"]["total_batches"] <= batches + 1  # at most the one the engine was in
        t0 = asyncio.get_running_loop().time()
        short = await pool.run_task(infer_spec("short", tmp_path / "b.jsonl", tmp_path / "b-out.jsonl"))
        assert short.counts["ok"] == 4 and asyncio.get_running_loop().time() - t0 < 1.5  # the slot was free
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert not (tmp_path / "a-out.jsonl").exists()


async def test_a_cancelled_retry_task_keeps_its_checkpointed_records_and_reports_them(tmp_path: Path, inprocess_pool) -> None:
    """A retry task reports after each committed chunk how many records it finished (its
    ``progress_url``), and cancelled mid-shard it flushes its checkpoints before it ends: every
    finished record, errors included, is on storage for the delivery of a cancelled batch."""
    write_shard(tmp_path / "in.jsonl", 200)
    ckpt, progress = str(tmp_path / "ckpt"), tmp_path / "live" / "part-00000.jsonl"
    slow = {**SIM_ENGINE, "simulated": {"latency_a_s": 0.05, "latency_b_s": 0.0}}
    spec = TaskSpec(task_id="cut", kind="retry", input_url=str(tmp_path / "in.jsonl"), max_attempts=1, chunk_size=4,
                    judge=JudgeConfig(kind="rule", callable="min_length", kwargs={"min_chars": 0}),
                    infer=InferConfig(template="{q}", sampling=SamplingConfig(temperature=1.0)),
                    outputs={"output": str(tmp_path / "out.jsonl"), "checkpoint": ckpt}, progress_url=str(progress))
    async with inprocess_pool(slow, batcher={"max_batch_size": 4}, checkpoint_interval_s=3600) as pool:
        caller = asyncio.create_task(pool.run_task(spec))
        await asyncio.sleep(0.6)
        reported = read_rows(progress)[0]
        assert reported["committed"] and 0 < reported["records"] < 200 and reported["counts"] == {"approved": reported["records"]}
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
    finals = [s["final"] for s in (await CheckpointStore(ckpt).load()).values() if s.get("final")]
    assert reported["records"] <= len(finals) < 200 and {f["status"] for f in finals} == {"approved"}
    assert not (tmp_path / "out.jsonl").exists()  # the shard itself is never committed half


async def test_retried_tasks_are_counted_as_pool_client_counts_them(tmp_path: Path, inprocess_pool) -> None:
    # the input appears only after the first try failed (a storage blip): one retry, then success
    src = tmp_path / "late.jsonl"
    async with inprocess_pool(retries=2, backoff_s=0.05) as pool:
        runtime = pool.runtime

        async def appear_after_first_failure() -> None:
            while runtime.counters["failed"] < 1:
                await asyncio.sleep(0.005)
            write_shard(src, 5)

        appear = asyncio.create_task(appear_after_first_failure())
        result = await pool.run_task(infer_spec("late", src, tmp_path / "late-out.jsonl"))
        await appear
        assert result.counts == {"ok": 5, "error": 0}
        assert pool.retried == 1 and (await pool.stats())["retried"] == 1
        with pytest.raises(TaskFailed):  # exhausted retries count too
            await pool.run_task(infer_spec("never", tmp_path / "missing.jsonl", tmp_path / "never-out.jsonl"))
        assert pool.retried == 3


class _FlakyStore:
    """A checkpoint store whose first ``fail`` appends raise (storage briefly down)."""

    url = "memory://flaky-checkpoints"

    def __init__(self, fail: int) -> None:
        self.fail, self.calls = fail, 0
        self.written: list[dict] = []

    async def append(self, states: list[dict]) -> None:
        self.calls += 1
        if self.calls <= self.fail:
            raise OSError(f"store down (call {self.calls})")
        self.written.extend(states)


async def test_a_failing_periodic_checkpoint_flush_is_reported_and_ticking_goes_on() -> None:
    from batch_inference.pool.retry import CheckpointBuffer

    store = _FlakyStore(fail=2)
    async with CheckpointBuffer(store, interval_s=0.01) as ckpt:  # type: ignore[arg-type]
        ckpt.add({"id": "a", "attempt": 1})
        for _ in range(200):  # the ticker keeps going after two failed flushes
            if store.written:
                break
            await asyncio.sleep(0.01)
        assert store.written == [{"id": "a", "attempt": 1}]
        ckpt.add({"id": "b", "attempt": 1})
    assert [s["id"] for s in store.written] == ["a", "b"]  # nothing lost, the final flush too
    assert ckpt.failures == 2
    note = ckpt.failure_note()
    assert note is not None and "failed 2 time(s)" in note and "store down" in note and "all states written" in note


async def test_checkpoint_flush_failures_reach_the_task_result(tmp_path: Path, inprocess_pool, monkeypatch) -> None:
    """A retry task whose first periodic flushes fail still succeeds, and its result says so."""
    real_append = CheckpointStore.append
    calls = {"n": 0}

    async def flaky_append(self, states):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("store down")
        await real_append(self, states)

    monkeypatch.setattr(CheckpointStore, "append", flaky_append)
    write_shard(tmp_path / "in.jsonl.zst", 20)
    spec = TaskSpec(task_id="t-ckpt", kind="retry", input_url=str(tmp_path / "in.jsonl.zst"),
                    outputs={"output": str(tmp_path / "out.jsonl.zst"), "checkpoint": str(tmp_path / "ckpt")},
                    infer=InferConfig(template="{q}", sampling=SamplingConfig(max_tokens=4)),
                    judge=LLM_JUDGE, max_attempts=2, chunk_size=20)
    slow = {**SIM_ENGINE, "simulated": {**SIM_ENGINE["simulated"], "latency_a_s": 0.05}}  # ticks land mid-chunk
    async with inprocess_pool(slow, checkpoint_interval_s=0.005) as pool:
        result = await pool.run_task(spec)
    assert sum(result.counts.values()) == 20
    assert len(result.warnings) == 1 and "checkpoint flush failed 1 time(s)" in result.warnings[0]
