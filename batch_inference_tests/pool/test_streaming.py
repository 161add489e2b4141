"""The streaming path of the pool (StreamGate, EngineHost, tasks, worker health) over a
small in-test StreamingEngine; real vLLM behind the same path: batch_inference_tests/vllm_cpu."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from batch_inference.engines import Completion, EngineDeadError, EngineOccupancy, SamplingParams, Tokens, is_streaming
from batch_inference.pool import InferConfig, SamplingConfig
from batch_inference.pool import engine_host as engine_host_module
from batch_inference.pool.engine_host import EngineHost
from batch_inference.pool.request import GenRequest
from batch_inference.pool.runtime import WorkerRuntime
from batch_inference.pool.worker import WorkerSettings, create_app
from batch_inference.pool.metrics import prometheus_text
from batch_inference_tests.fixtures.pool import infer_spec, read_rows, write_shard


class ToyStream:
    """A continuous-batching stand-in: each request takes ``max_tokens`` ms, alone.

    A prompt containing "die" kills it (``EngineDeadError`` for that request and every
    later one); "bad" is a per-request error. ``active`` is what it is decoding now.
    """

    name = "toy-stream"
    max_model_len = 4096
    simulated = True

    def __init__(self, capacity: int = 4) -> None:
        self._capacity = capacity
        self.active: set[int] = set()
        self.peak = 0
        self.cancelled = 0
        self.dead = False
        self._ids = 0

    def encode(self, prompts: list[str]) -> list[Tokens]:
        return [Tokens(range(len(p.split())), p) for p in prompts]

    async def start(self) -> None:
        pass

    async def complete(self, prompt: str | Tokens, params: SamplingParams) -> Completion:
        prompt = prompt.source if isinstance(prompt, Tokens) else prompt
        if self.dead or "die" in prompt:
            self.dead = True
            raise EngineDeadError("toy engine core exited")
        if "bad" in prompt:
            return Completion.failed("engine_error: bad request")
        self._ids += 1
        rid = self._ids
        self.active.add(rid)
        self.peak = max(self.peak, len(self.active))
        try:
            await asyncio.sleep(params.max_tokens / 1000)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active.discard(rid)
        return Completion(f"{prompt}|{params.seed}", len(prompt.split()), params.max_tokens, "length")

    def capacity(self) -> int:
        return self._capacity

    def occupancy(self) -> EngineOccupancy:
        return EngineOccupancy(running=len(self.active), waiting=0, max_num_seqs=self._capacity, kv_cache_usage=0.5)

    async def aclose(self) -> None:
        pass


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ToyStream:
    engine = ToyStream()
    monkeypatch.setattr(engine_host_module, "build_engine", lambda cfg: engine)
    return engine


SIM = {"kind": "simulated"}


async def test_gate_bounds_in_flight_and_each_completion_resolves_alone(toy: ToyStream) -> None:
    assert is_streaming(toy)
    async with EngineHost(SIM) as host:
        assert host.streaming and host.batcher is None
        lengths = [80, 5, 40, 1, 20, 10, 60, 2, 30, 3]
        order: list[int] = []
        futures = await host.submit([GenRequest(f"p{i}", SamplingParams(max_tokens=n), 0) for i, n in enumerate(lengths)])
        for i, f in enumerate(futures):
            f.add_done_callback(lambda _, i=i: order.append(i))
        done = await asyncio.gather(*futures)
        assert [c.completion_tokens for c in done] == lengths and [c.text for c in done] == [f"p{i}|None" for i in range(10)]
        assert toy.peak == 4 and host.gate.peak_in_flight == 4  # type: ignore[union-attr]
        assert order[0] != 0 and order.index(3) < order.index(0)  # no batch barrier
        stats = host.gate.stats  # type: ignore[union-attr]
        assert stats.total_completed == 10 and stats.output_tokens == sum(lengths) and 0 < stats.avg_fill <= 1
        assert stats.busy_time_s > 0 and stats.utilization <= 1


async def until(predicate, timeout_s: float = 10.0) -> None:
    """Wait until ``predicate()`` holds (a loaded machine takes longer to get there), at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, f"not reached within {timeout_s} s"
        await asyncio.sleep(0.005)


async def test_submit_suspends_while_full_which_is_the_backpressure(toy: ToyStream) -> None:
    async with EngineHost(SIM) as host:
        producer = asyncio.create_task(host.submit([GenRequest(f"p{i}", SamplingParams(max_tokens=50), 0) for i in range(12)]))
        await until(lambda: len(toy.active) == 4)
        assert not producer.done() and len(toy.active) == 4  # 8 requests wait in the producer, not in the engine
        futures = await producer
        assert host.gate.submitted == 12 and len(toy.active) <= 4  # type: ignore[union-attr]
        await asyncio.gather(*futures)


async def test_cancelled_task_cancels_its_requests_in_the_engine(toy: ToyStream, tmp_path: Path) -> None:
    write_shard(tmp_path / "in.jsonl", 20)
    infer = InferConfig(template="{q}", sampling=SamplingConfig(max_tokens=4000))
    async with EngineHost(SIM) as host:
        runtime = WorkerRuntime(host, concurrency=1)
        task = asyncio.create_task(runtime.run(infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=infer)))
        await until(lambda: len(toy.active) == 4)  # the task reads, encodes (off the loop) and submits first
        assert await runtime.drain(grace_s=0) == ["t"]
        with pytest.raises(Exception):
            await task
        await asyncio.sleep(0)
        assert not toy.active and toy.cancelled == 4 and host.gate.in_flight == 0  # type: ignore[union-attr]
        assert not (tmp_path / "out.jsonl").exists()


async def test_streamed_task_rows_carry_their_own_results_and_per_record_errors(toy: ToyStream, tmp_path: Path) -> None:
    from batch_inference.storage import JsonlFile

    with JsonlFile(str(tmp_path / "in.jsonl")).writer_sync() as w:
        w.write_many([{"id": f"r{i}", "q": ("bad one" if i == 3 else f"q{i}"), "n": 1 + (7 * i) % 30} for i in range(12)])
    infer = InferConfig(template="{q}", sampling=SamplingConfig(max_tokens=16, seed=9))
    async with EngineHost(SIM) as host:
        runtime = WorkerRuntime(host, concurrency=2)
        result = await runtime.run(infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=infer, chunk_size=5))
        stats = runtime.stats()
    rows = read_rows(tmp_path / "out.jsonl")
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(12)]
    assert result.counts == {"ok": 11, "error": 1} and rows[3]["error"] == "engine_error: bad request"
    assert all(r["result"].startswith(f"q{i}|") for i, r in enumerate(rows) if i != 3)
    assert result.tokens_out == 11 * 16 and result.engine_busy_s > 0
    assert stats["mode"] == "stream" and stats["capacity"] == 4 and stats["output_tokens_per_s"] > 0
    assert stats["kv_cache_usage"] == 0.5 and stats["stream"]["total_failed"] == 1
    text = prometheus_text(stats)
    assert "batch_inference_output_tokens_per_second" in text and "batch_inference_engine_kv_cache_usage" in text


@pytest.mark.process
async def test_dead_engine_fails_the_task_never_its_records_and_the_worker_goes_unhealthy(toy: ToyStream, tmp_path: Path) -> None:
    write_shard(tmp_path / "in.jsonl", 10)
    die = InferConfig(template="{q} die", sampling=SamplingConfig(max_tokens=8))
    async with EngineHost(SIM) as host:
        runtime = WorkerRuntime(host, concurrency=2)
        stopped: list[str] = []
        runtime.on_engine_dead = stopped.append
        app = create_app(runtime, WorkerSettings(storage_roots=[str(tmp_path)]))
        async with TestClient(TestServer(app)) as client:
            spec = infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=die)
            resp = await client.post("/tasks", data=spec.model_dump_json())
            body = await resp.json()
            assert resp.status == 503 and body["retryable"] is True and "engine dead" in body["error"]
            assert stopped and runtime.engine_dead and "toy engine core exited" in runtime.engine_dead
            health = await client.get("/health")
            assert health.status == 503 and (await health.json())["status"] == "unhealthy"
            again = await client.post("/tasks", data=infer_spec("u", tmp_path / "in.jsonl", tmp_path / "u.jsonl").model_dump_json())
            assert again.status == 503 and (await again.json())["retryable"] is True
    assert not (tmp_path / "out.jsonl").exists()  # no record was written as failed


async def test_inprocess_pool_stops_the_run_on_a_dead_engine_instead_of_quarantining(toy: ToyStream, tmp_path: Path, inprocess_pool: Any) -> None:
    from batch_inference.pool import TaskFailed

    write_shard(tmp_path / "in.jsonl", 5)
    die = InferConfig(template="{q} die", sampling=SamplingConfig(max_tokens=8))
    async with inprocess_pool(SIM, retries=2) as pool:
        with pytest.raises(EngineDeadError) as info:
            await pool.run_task(infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=die))
        assert not isinstance(info.value, TaskFailed) and pool.retried == 0


class RecordingStream(ToyStream):
    """ToyStream that notes the order requests reach the engine in."""

    def __init__(self, capacity: int = 2) -> None:
        super().__init__(capacity)
        self.started: list[str] = []

    async def complete(self, prompt: str | Tokens, params: SamplingParams) -> Completion:
        self.started.append(prompt.source if isinstance(prompt, Tokens) else prompt)
        return await super().complete(prompt, params)


@pytest.mark.parametrize("together", [True, False])
async def test_together_submissions_reach_the_engine_as_runs(monkeypatch: pytest.MonkeyPatch, together: bool) -> None:
    engine = RecordingStream(capacity=2)
    monkeypatch.setattr(engine_host_module, "build_engine", lambda cfg: engine)
    async with EngineHost(SIM) as host:
        async def task(name: str) -> None:
            futures = await host.submit([GenRequest(f"{name}{i}", SamplingParams(max_tokens=3), 0) for i in range(6)], together=together)
            await asyncio.gather(*futures)

        await asyncio.gather(task("a"), task("b"))
    runs = [p[0] for p in engine.started]
    changes = sum(1 for x, y in zip(runs, runs[1:]) if x != y)
    if together:  # one task's requests all go in before the other's: its prefix family stays together
        assert changes == 1, engine.started
    else:  # taking turns for slots interleaves the two tasks' requests
        assert changes > 2, engine.started


async def test_prefix_order_submits_sorted_and_writes_rows_in_input_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from batch_inference.storage import JsonlFile

    engine = RecordingStream(capacity=3)
    monkeypatch.setattr(engine_host_module, "build_engine", lambda cfg: engine)
    docs = ["doc C", "doc A", "doc B"]
    with JsonlFile(str(tmp_path / "in.jsonl")).writer_sync() as w:
        w.write_many([{"id": f"r{i}", "q": f"{docs[i % 3]} q{i // 3}"} for i in range(9)])  # interleaved families
    infer = InferConfig(template="{q}", sampling=SamplingConfig(max_tokens=2, seed=1))
    async with EngineHost(SIM) as host:
        runtime = WorkerRuntime(host, concurrency=1)
        await runtime.run(infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=infer, chunk_size=9, order="prefix"))
    assert engine.started == sorted(engine.started)  # families side by side into the engine
    rows = read_rows(tmp_path / "out.jsonl")
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(9)]  # rows stay in the shard's order
    assert all(r["result"].startswith(f"{docs[i % 3]} q{i // 3}|") for i, r in enumerate(rows))
