"""Each replica of a local pool computes on its own share of the host (pool.launchers.devices)."""

from __future__ import annotations

import logging
from pathlib import Path

import psutil
import pytest

from batch_inference.engines import EngineConfig
from batch_inference.pool.launchers.devices import CPU_BIND_ENV, GPU_ENV, DevicesError, replica_environments, visible_gpus
from batch_inference_tests.fixtures.pool import run_shards


def vllm(tp: int = 1, device: str = "auto") -> EngineConfig:
    return EngineConfig(kind="vllm", model="m", device=device, vllm={"tensor_parallel_size": tp})  # type: ignore[arg-type]


def test_gpus_are_split_in_tensor_parallel_groups(caplog: pytest.LogCaptureFixture) -> None:
    gpus = ["0", "1", "2", "3"]
    assert replica_environments(vllm(tp=2), 2, environ={}, gpus=gpus) == [{GPU_ENV: "0,1"}, {GPU_ENV: "2,3"}]
    assert replica_environments(vllm(), 4, environ={}, gpus=gpus) == [{GPU_ENV: g} for g in gpus]
    transformers = EngineConfig(kind="transformers", model="m")
    assert replica_environments(transformers, 2, environ={}, gpus=gpus) == [{GPU_ENV: "0"}, {GPU_ENV: "1"}]
    with caplog.at_level(logging.WARNING):  # more replicas than groups: round-robin, said
        assert replica_environments(vllm(tp=2), 3, environ={}, gpus=gpus) == [{GPU_ENV: "0,1"}, {GPU_ENV: "2,3"}, {GPU_ENV: "0,1"}]
    assert "replicas share GPUs" in caplog.text
    with pytest.raises(DevicesError, match="needs 8 GPUs"):
        replica_environments(vllm(tp=8), 1, environ={}, gpus=gpus)


def test_the_environments_gpus_are_the_ones_shared_out() -> None:
    env = {GPU_ENV: "2, 3"}
    assert visible_gpus(env) == ["2", "3"]
    assert replica_environments(vllm(), 2, environ=env) == [{GPU_ENV: "2"}, {GPU_ENV: "3"}]
    assert visible_gpus({GPU_ENV: ""}) == []  # every GPU hidden: a CPU host


def test_vllm_cpu_replicas_bind_disjoint_cores(caplog: pytest.LogCaptureFixture) -> None:
    none: list[str] = []
    assert replica_environments(vllm(), 2, environ={}, gpus=none, cores=[0, 1]) == [{CPU_BIND_ENV: "0"}, {CPU_BIND_ENV: "1"}]
    assert replica_environments(vllm(), 3, environ={}, gpus=none, cores=range(8)) == [
        {CPU_BIND_ENV: "0,1,2"}, {CPU_BIND_ENV: "3,4,5"}, {CPU_BIND_ENV: "6,7"}]
    assert replica_environments(vllm(tp=2), 2, environ={}, gpus=none, cores=range(8)) == [
        {CPU_BIND_ENV: "0,1|2,3"}, {CPU_BIND_ENV: "4,5|6,7"}]  # one list a rank
    assert replica_environments(vllm(device="cpu"), 2, environ={}, gpus=["0"], cores=[4, 5]) == [
        {CPU_BIND_ENV: "4"}, {CPU_BIND_ENV: "5"}]  # device cpu: the GPU is not this engine's
    with caplog.at_level(logging.WARNING):
        assert replica_environments(vllm(), 3, environ={}, gpus=none, cores=[0, 1]) == [
            {CPU_BIND_ENV: "0"}, {CPU_BIND_ENV: "1"}, {CPU_BIND_ENV: "0"}]
        assert replica_environments(vllm(tp=2), 2, environ={}, gpus=none, cores=[0, 1]) == [{}, {}]  # too few: vLLM's own
    assert "replicas share cores" in caplog.text and "left to vLLM's own binding" in caplog.text
    # one replica keeps vLLM's own binding; a binding set by hand is kept; other engines are left alone
    assert replica_environments(vllm(), 1, environ={}, gpus=none, cores=[0, 1]) == [{}]
    assert replica_environments(vllm(), 2, environ={CPU_BIND_ENV: "nobind"}, gpus=none, cores=[0, 1]) == [{}, {}]
    assert replica_environments(EngineConfig(kind="transformers", model="m"), 2, environ={}, gpus=none, cores=[0, 1]) == [{}, {}]
    assert replica_environments(EngineConfig(kind="simulated"), 2, environ={}, gpus=["0"], cores=[0, 1]) == [{}, {}]


@pytest.mark.slow
async def test_each_local_worker_starts_with_its_own_gpu(tmp_path: Path, local_pool, tiny_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two transformers workers under CUDA_VISIBLE_DEVICES=7,9: each process sees one of
    them (no GPU here, so each then runs on the CPU), and both serve tasks."""
    monkeypatch.setenv(GPU_ENV, "7,9")
    launcher = local_pool({"kind": "transformers", "model": str(tiny_model_dir)}, replicas=2, concurrency=2)
    workers = launcher.status()
    assert sorted(psutil.Process(w.pid).environ().get(GPU_ENV) for w in workers) == ["7", "9"]
    from batch_inference.pool import InferConfig, SamplingConfig

    infer = InferConfig(template="Q: {q}\nA:", sampling=SamplingConfig(max_tokens=2, temperature=0.0))
    results = await run_shards(launcher, tmp_path, 2, 3, infer)
    assert [r.counts for r in results] == [{"ok": 3, "error": 0}] * 2
