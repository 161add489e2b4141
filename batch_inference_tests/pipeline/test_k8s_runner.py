"""``pool.launcher: k8s``: the pipeline discovers a deployed pool's ready pods through K8sLauncher.

The Kubernetes API is a fake answering ``read_namespaced_endpoints`` with the client's own
models; the "pod" behind it is a real worker process on loopback that requires the token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from kubernetes import client

from batch_inference.pipeline import PipelineSpec, SpecError, run_pipeline
from batch_inference.pipeline.runner import open_runner
from batch_inference_tests.pipeline.helpers import spec_dict


class FakeCoreV1:
    """The CoreV1Api call endpoint discovery makes: ready and not-ready addresses per port."""

    def __init__(self, ready: list[tuple[str, int]], not_ready: list[tuple[str, int]]) -> None:
        self.ready, self.not_ready = ready, not_ready
        self.calls: list[tuple[str, str]] = []

    def read_namespaced_endpoints(self, name: str, namespace: str) -> client.V1Endpoints:
        self.calls.append((name, namespace))
        subsets = [client.V1EndpointSubset(addresses=[client.V1EndpointAddress(ip=ip)],
                                           ports=[client.CoreV1EndpointPort(name="http", port=port)]) for ip, port in self.ready]
        subsets += [client.V1EndpointSubset(not_ready_addresses=[client.V1EndpointAddress(ip=ip)],
                                            ports=[client.CoreV1EndpointPort(name="http", port=port)]) for ip, port in self.not_ready]
        return client.V1Endpoints(subsets=subsets)


def test_k8s_without_endpoints_needs_a_token_env(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="token_env"):
        PipelineSpec.parse(spec_dict(tmp_path, pool={"launcher": "k8s"}))
    # explicit endpoints stay an override (no discovery)
    spec = PipelineSpec.parse(spec_dict(tmp_path, pool={"launcher": "k8s", "endpoints": ["http://10.0.0.1:8700"]}))
    assert spec.pool.endpoints == ["http://10.0.0.1:8700"]


async def test_k8s_launcher_discovers_the_ready_pods_and_runs_the_pipeline(local_pool, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BATCH_INFERENCE_TOKEN", "k8s-secret-token")  # the worker requires it, as a pod's would
    engine = {"kind": "simulated", "simulated": {"approval_rate": 0.6, "latency_a_s": 0.0002, "latency_b_s": 0.0}}
    launcher = await asyncio.to_thread(local_pool, engine_config=engine, replicas=1, concurrency=2)
    (endpoint,) = launcher.endpoints()
    port = int(endpoint.rsplit(":", 1)[1])
    fake = FakeCoreV1(ready=[("127.0.0.1", port)], not_ready=[("10.9.9.9", 8700)])
    spec = PipelineSpec.parse(spec_dict(
        tmp_path, records=200, engine=engine,
        pool={"launcher": "k8s", "k8s_name": "bi-workers", "namespace": "batch", "token_env": "BATCH_INFERENCE_TOKEN",
              "concurrency": 2, "retries": 0},
    ))
    async with open_runner(spec, k8s_api=fake) as runner:
        assert runner.endpoints == [f"http://127.0.0.1:{port}"]  # ready pods only
        assert runner.limit == 2 and runner.token == "k8s-secret-token"
        summary = await run_pipeline(spec, runner=runner)
    assert set(fake.calls) == {("bi-workers", "batch")}
    assert summary.conservation["ok"] and summary.approved + summary.exhausted == 200
    # a wrong token is refused by the worker: the token really travelled
    monkeypatch.setenv("BATCH_INFERENCE_TOKEN", "wrong")
    wrong = spec.model_copy(update={"run": "wrong-token"})
    async with open_runner(wrong, k8s_api=fake) as runner:
        refused = await run_pipeline(wrong, runner=runner)
    assert refused.status == "quarantined" and refused.failed == 200
    infer = orjson.loads((tmp_path / "out" / "wrong-token" / "ledger" / "round-00-infer.json").read_bytes())
    assert all("HTTP 401" in q["error"] for q in infer["quarantined"])
