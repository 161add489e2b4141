"""Identical requests computed once (pool.dedup): what merges, what never does, and retries."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from batch_inference.engines import ChatPrompt, Completion, EngineDeadError, ResponseFormat, SamplingParams, Tokens
from batch_inference.judges import JudgeConfig
from batch_inference.pool import InferConfig, SamplingConfig, TaskSpec
from batch_inference.pool.dedup import Orphaned, RequestMemo, request_key
from batch_inference.rows import ErrorKind
from batch_inference.storage import JsonlFile
from batch_inference_tests.fixtures.pool import read_rows

GREEDY_SIM = {"kind": "simulated", "simulated": {"latency_a_s": 0.0005, "latency_b_s": 0.0, "greedy": "prompt"}}
GREEDY = InferConfig(template="Answer: {q}", sampling=SamplingConfig(max_tokens=8, temperature=0.0, seed=3))


def key(prompt: Any = "p", params: SamplingParams | None = None, attempt: int = 0, scope: str = "run/r00/infer",
        ignores: bool = True) -> bytes | None:
    return request_key(scope, prompt, params or SamplingParams(max_tokens=8, seed=1), attempt, greedy_ignores_seed=ignores)


def test_keys_merge_only_identical_deterministic_requests() -> None:
    base = SamplingParams(max_tokens=8, temperature=0.0, seed=1)
    # greedy on an engine whose greedy ignores the seed: per-record seeds do not split it
    assert key(params=base) == key(params=SamplingParams(max_tokens=8, temperature=0.0, seed=99))
    # ... but do where the seed drives even greedy output (the default simulated engine)
    assert key(params=base, ignores=False) != key(params=SamplingParams(max_tokens=8, seed=99), ignores=False)
    different = [
        SamplingParams(max_tokens=9, seed=1),
        SamplingParams(max_tokens=8, temperature=0.5, seed=1),
        SamplingParams(max_tokens=8, top_p=0.9, seed=1),
        SamplingParams(max_tokens=8, stop=("x",), seed=1),
        SamplingParams(max_tokens=8, min_tokens=2, seed=1),
        SamplingParams(max_tokens=8, seed=1, response_format=ResponseFormat("json_object")),
    ]
    keys = {key(params=p) for p in [base, *different]}
    assert len(keys) == 1 + len(different)
    # sampled: the same explicit seed is the same sample, another seed or none is not
    hot = SamplingParams(max_tokens=8, temperature=0.7, seed=5)
    assert key(params=hot) == key(params=SamplingParams(max_tokens=8, temperature=0.7, seed=5)) is not None
    assert key(params=hot) != key(params=SamplingParams(max_tokens=8, temperature=0.7, seed=6))
    assert key(params=SamplingParams(max_tokens=8, temperature=0.7, seed=None)) is None
    # the prompt, its kind, the attempt and the phase are all part of it
    assert key("p") != key("q")
    assert key("p") != key(ChatPrompt((("user", "p"),)))
    assert key(attempt=0) != key(attempt=1)
    assert key(scope="run/r00/infer") != key(scope="run/r01/infer")


async def test_memo_shares_a_result_and_survives_the_leader_leaving() -> None:
    memo = RequestMemo()
    engine: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
    k = b"k" * 16
    leader = memo.lead(k)
    memo.attach(k, engine)
    joined = memo.answer(k)
    assert isinstance(joined, asyncio.Future)
    leader.cancel()  # the leader's task went away: the engine keeps the request for the other
    await asyncio.sleep(0)
    assert not engine.cancelled()
    engine.set_result(Completion("out", 3, 1, "stop"))
    assert (await joined).text == "out"
    assert memo.answer(k).text == "out"  # replayed from the finished results
    # every waiter gone: the engine request is aborted
    k2 = b"j" * 16
    engine2: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
    only = memo.lead(k2)
    memo.attach(k2, engine2)
    only.cancel()
    await asyncio.sleep(0)
    assert engine2.cancelled()


async def test_memo_never_shares_a_failure_except_a_dead_engine() -> None:
    memo = RequestMemo()
    loop = asyncio.get_running_loop()
    for outcome in (Completion.failed(ErrorKind.ENGINE_ERROR.tag("blip")), RuntimeError("batch failed")):
        k = repr(outcome).encode()[:16].ljust(16, b"_")
        engine: asyncio.Future[Completion] = loop.create_future()
        leader = memo.lead(k)
        memo.attach(k, engine)
        other = memo.answer(k)
        engine.set_exception(outcome) if isinstance(outcome, Exception) else engine.set_result(outcome)
        await asyncio.gather(leader, other, return_exceptions=True)
        if isinstance(outcome, Exception):
            assert leader.exception() is outcome
        else:
            assert leader.result() is outcome
        assert isinstance(other.exception(), Orphaned)  # it runs its own request
        assert memo.answer(k) is None  # nothing remembered: the next one leads
        memo.abandon(k)
    k = b"d" * 16
    engine = loop.create_future()
    leader = memo.lead(k)
    memo.attach(k, engine)
    other = memo.answer(k)
    engine.set_exception(EngineDeadError("gone"))
    for f in (leader, other):
        with pytest.raises(EngineDeadError):
            await f


def _count_answers(pool) -> Counter[str]:
    """Counts the engine's computations per prompt (the simulated engine's one answer path)."""
    engine = pool.host.engine
    seen: Counter[str] = Counter()
    real = engine.answer

    def counted(prompt, params):
        source = prompt.source if isinstance(prompt, Tokens) else prompt
        seen[source if isinstance(source, str) else repr(source)] += 1
        return real(prompt, params)

    engine.answer = counted
    return seen


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    with JsonlFile(str(path)).writer_sync() as w:
        w.write_many(records)


def _infer(task_id: str, src: Path, dst: Path, *, scope: str | None, infer: InferConfig = GREEDY, **kw: Any) -> TaskSpec:
    return TaskSpec(task_id=task_id, kind="infer", input_url=str(src), outputs={"output": str(dst)}, infer=infer,
                    dedup_scope=scope, **kw)


async def test_repeats_run_once_across_tasks_and_rows_are_unchanged(tmp_path: Path, inprocess_pool) -> None:
    questions = ["a", "b", "c", "a", "a", "b"]
    _write(tmp_path / "s0.jsonl", [{"id": f"x{i}", "q": q} for i, q in enumerate(questions)])
    _write(tmp_path / "s1.jsonl", [{"id": f"y{i}", "q": q} for i, q in enumerate(["c", "a", "d"])])
    rows: dict[str | None, dict[str, dict]] = {}
    for scope in ("run/r00/infer", None):
        async with inprocess_pool(GREEDY_SIM, concurrency=2) as pool:
            seen = _count_answers(pool)
            results = [await pool.run_task(_infer(f"{scope}-{s}", tmp_path / f"{s}.jsonl", tmp_path / f"{s}-{scope is None}.jsonl",
                                                  scope=scope, chunk_size=2)) for s in ("s0", "s1")]
        rows[scope] = {r["id"]: r for s in ("s0", "s1") for r in read_rows(tmp_path / f"{s}-{scope is None}.jsonl")}
        if scope is None:
            assert sum(seen.values()) == 9 and all(r.duplicates == 0 for r in results)
        else:
            assert set(seen.values()) == {1} and len(seen) == 4  # a, b, c, d: once each, across chunks and tasks
            assert [r.duplicates for r in results] == [3, 2]
            dup_rows = [rows[scope][i] for i in ("x3", "x4", "x5", "y0", "y1")]
            assert results[0].duplicate_tokens_out + results[1].duplicate_tokens_out == sum(
                r["usage"]["completion_tokens"] for r in dup_rows) > 0
            assert sum(r.tokens_out for r in results) == sum(r["usage"]["completion_tokens"] for r in rows[scope].values())
    assert rows["run/r00/infer"] == rows[None]  # every record its own row, the same with the memo on or off


async def test_requests_whose_sampling_differs_never_merge(tmp_path: Path, inprocess_pool) -> None:
    overrides = [None, {"max_tokens": 5}, {"temperature": 0.9}, {"temperature": 0.9}, {"stop": ["x"]},
                 {"seed": 11, "temperature": 0.9}, {"min_tokens": 2}, None]
    records = [{"id": f"r{i}", "q": "same", **({"sampling": o} if o else {})} for i, o in enumerate(overrides)]
    _write(tmp_path / "in.jsonl", records)
    async with inprocess_pool(GREEDY_SIM) as pool:
        seen = _count_answers(pool)
        result = await pool.run_task(_infer("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl", scope="run/r00/infer"))
    # only the two records with the spec's own greedy sampling merge; sampled ones carry
    # per-record seeds (derive_seed), so even the same explicit base seed is a different sample
    assert result.duplicates == 1 and sum(seen.values()) == len(records) - 1


REJECT_ALL = JudgeConfig(kind="rule", callable="regex", kwargs={"pattern": "no such word anywhere"})


async def test_an_in_place_retry_is_never_answered_from_a_rejected_result(tmp_path: Path, inprocess_pool) -> None:
    _write(tmp_path / "in.jsonl", [{"id": "a", "q": "same"}, {"id": "b", "q": "same"}])
    spec = TaskSpec(task_id="tail/0", kind="retry", input_url=str(tmp_path / "in.jsonl"),
                    outputs={"output": str(tmp_path / "out.jsonl"), "checkpoint": str(tmp_path / "ckpt")},
                    infer=GREEDY, judge=REJECT_ALL, max_attempts=3, dedup_scope="run/r00/retry")
    async with inprocess_pool(GREEDY_SIM) as pool:
        seen = _count_answers(pool)
        result = await pool.run_task(spec)
    # three attempts, each computed once for both records: an attempt's key holds its number
    assert seen == Counter({"Answer: same": 3})
    assert result.duplicates == 3
    assert [(r["id"], r["status"], r["attempts"]) for r in read_rows(tmp_path / "out.jsonl")] == [
        ("a", "max_attempts", 3), ("b", "max_attempts", 3)]


async def test_a_later_round_is_its_own_computation(tmp_path: Path, inprocess_pool) -> None:
    _write(tmp_path / "r0.jsonl", [{"id": "a", "q": "same"}])
    _write(tmp_path / "r1.jsonl", [{"id": "b", "q": "same", "attempts": 1}])
    async with inprocess_pool(GREEDY_SIM) as pool:
        seen = _count_answers(pool)
        await pool.run_task(_infer("r0", tmp_path / "r0.jsonl", tmp_path / "o0.jsonl", scope="run/r00/infer"))
        await pool.run_task(_infer("r1", tmp_path / "r1.jsonl", tmp_path / "o1.jsonl", scope="run/r01/infer", round=1))
    assert seen == Counter({"Answer: same": 2})


async def test_a_duplicate_whose_leader_failed_runs_on_its_own(tmp_path: Path, inprocess_pool) -> None:
    _write(tmp_path / "in.jsonl", [{"id": "a", "q": "flaky"}, {"id": "b", "q": "flaky"}, {"id": "c", "q": "flaky"}])
    async with inprocess_pool(GREEDY_SIM) as pool:
        engine = pool.host.engine
        real, calls = engine.answer, []

        def flaky(prompt, params):  # the first computation of the prompt fails, later ones work
            calls.append(prompt)
            if len(calls) == 1:
                return Completion.failed(ErrorKind.ENGINE_ERROR.tag("transient"))
            return real(prompt, params)

        engine.answer = flaky
        result = await pool.run_task(_infer("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl", scope="run/r00/infer"))
    rows = {r["id"]: r for r in read_rows(tmp_path / "out.jsonl")}
    assert "engine_error" in rows["a"]["error"]  # the leader keeps its own failure
    assert rows["b"]["result"] and rows["c"]["result"] == rows["b"]["result"]  # never inherited
    assert result.counts == {"ok": 2, "error": 1}


async def test_a_generate_cancelled_between_slices_leaves_no_lead_behind(tmp_path: Path, inprocess_pool) -> None:
    """``TaskContext.generate`` gives the loop back every ``pool.slices.SLICE`` requests while it
    registers its leads with the memo; cancelled there (or in the submit), every lead it made is
    abandoned, so a retried task's identical request runs instead of waiting on a flight that no
    engine future will ever settle."""
    from batch_inference.pool.context import TaskContext
    from batch_inference.pool.slices import SLICE
    from batch_inference.prompting import RequestBuilder

    slow = {"kind": "simulated", "simulated": {"latency_a_s": 0.05, "latency_b_s": 0.0, "greedy": "prompt"}}
    spec = _infer("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl", scope="run/r00/infer")
    builder = RequestBuilder(GREEDY)
    requests = [builder.build({"id": f"r{i}", "q": f"question {i}"}, 0) for i in range(3 * SLICE)]
    async with inprocess_pool(slow) as pool:
        memo = pool.host.memo
        for yields in range(1, 6):  # cancelled at a different suspension point each time
            run = asyncio.create_task(TaskContext(spec, pool.host).generate(requests, [0] * len(requests)))
            for _ in range(yields):
                await asyncio.sleep(0)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            assert memo.stats()["in_flight"] == 0, yields
        done = await asyncio.wait_for(TaskContext(spec, pool.host).generate(requests[:4], [0] * 4), 30)
        assert all(isinstance(c, Completion) and c.error is None for c in done)
