"""A real worker process whose vLLM engine core dies mid-task (``make test-vllm``).

The engine core is SIGKILLed while a task is decoding. The worker must not fail the
records: it answers 503 (retryable), reports itself unhealthy, exits non-zero, and the
client's retry lands on the replacement worker the launcher starts; every record of
the shard is then written once, with a result.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm")

from batch_inference.pool import InferConfig, SamplingConfig  # noqa: E402
from batch_inference_tests.fixtures.pool import infer_spec, read_rows, wait_until, write_shard  # noqa: E402

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]


def engine_config(model: Path) -> dict:
    return {"kind": "vllm", "model": str(model), "dtype": "float32", "max_model_len": 512,
            "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "max_num_seqs": 8}}}


def stats(endpoint: str) -> dict:
    with urllib.request.urlopen(f"{endpoint}/stats", timeout=5) as resp:
        return json.loads(resp.read())


def engine_core(worker_pid: int) -> psutil.Process:
    for child in psutil.Process(worker_pid).children(recursive=True):
        if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no vLLM engine core under worker {worker_pid}")


async def test_dead_engine_core_makes_the_worker_unhealthy_and_the_task_runs_elsewhere(
    tmp_path: Path, local_pool, tiny_model_dir: Path
) -> None:
    ids = write_shard(tmp_path / "in.jsonl", 40)
    launcher = local_pool(engine_config=engine_config(tiny_model_dir), replicas=1, concurrency=2, start_timeout_s=400)
    (first,) = launcher.status()
    infer = InferConfig(template="Answer: {q}", sampling=SamplingConfig(max_tokens=200, min_tokens=200, temperature=1.0, seed=3))
    spec = infer_spec("doomed", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=infer)
    async with launcher.client(retries=30, max_backoff_s=5.0) as client:
        task = asyncio.create_task(client.run_task(spec))
        await wait_until(lambda: task.done() or asyncio.to_thread(lambda: stats(first.endpoint)["in_flight"] > 0), timeout_s=300)
        assert not task.done(), f"the task ended before its requests reached the engine: {task.result()!r}"
        os.kill(engine_core(first.pid).pid, signal.SIGKILL)
        result = await task  # answered by the replacement worker
    assert result.counts == {"ok": 40, "error": 0} and result.worker != first.endpoint.split("//")[1]
    rows = read_rows(tmp_path / "out.jsonl")
    assert [r["id"] for r in rows] == ids and all(r["error"] is None and r["result"] is not None for r in rows)
    log = (launcher.dir / "worker-0.log").read_text(errors="replace")
    assert "engine dead" in log  # it said why it left
    assert not psutil.pid_exists(first.pid) or psutil.Process(first.pid).status() == psutil.STATUS_ZOMBIE
    (second,) = launcher.status()
    assert second.pid != first.pid and second.healthy
