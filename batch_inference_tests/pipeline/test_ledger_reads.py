"""The driver's ledger traffic on an object store: progress records read together, each once per phase.

A run on S3 (moto; SeaweedFS under ``make test-infra``) behind the tests' TCP proxy, which
adds latency and counts the HTTP requests it carries. At thousands of shards a read per
shard per call, several calls per phase, is minutes of round trips (bench/ledger_overhead.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import Ledger, PipelineRun, PipelineSpec, RunLayout
from batch_inference_tests.faults.tcp_proxy import TcpProxy
from batch_inference_tests.fixtures.s3 import S3Server
from batch_inference_tests.pipeline.helpers import InstantRunner

LATENCY_S = 0.02


@pytest.fixture
def slow_proxy(s3_store: S3Server) -> Iterator[TcpProxy]:
    with TcpProxy(s3_store.port, latency_s=LATENCY_S) as p:
        yield p


def _via(server: S3Server, endpoint: str) -> dict[str, Any]:
    return {**server.storage_options, "client_kwargs": {**server.storage_options.get("client_kwargs", {}), "endpoint_url": endpoint}}


def _spec(tmp_path: Path, bucket: str, options: dict[str, Any], shards: int) -> PipelineSpec:
    src = tmp_path / "input.jsonl"
    if not src.exists():
        src.write_bytes(b"".join(orjson.dumps({"id": f"r{i:04d}", "prompt": f"q {i}"}) + b"\n" for i in range(shards)))
    return PipelineSpec.parse({
        "run": "ledger-reads", "input": str(src), "output": f"{bucket}/runs", "storage_options": options,
        "engine": {"kind": "simulated"}, "infer": {"template": "{prompt}", "sampling": {"max_tokens": 4}},
        "judge": {"kind": "llm", "template": "{result}"}, "shard_records": 1, "pool": {"concurrency": 8},
    })


def test_progress_records_are_read_together_not_one_round_trip_each(s3_store: S3Server, slow_proxy: TcpProxy) -> None:
    bucket = s3_store.make_bucket()
    layout = RunLayout(f"{bucket}/runs", "progress")
    direct = Ledger(layout, s3_store.storage_options)
    n = 40
    for i in range(n):
        direct.write_progress("round-00-infer", i, {"index": i, "records_in": i})
    ledger = Ledger(layout, _via(s3_store, slow_proxy.url))
    got = ledger.progress("round-00-infer", list(range(n + 5)))  # 5 never finished
    assert list(got) == list(range(n)) and all(got[i] == {"index": i, "records_in": i} for i in got)
    assert slow_proxy.requests["GET"] == n + 1  # the listing and one GET per record
    # one by one, each record would wait for the one before it: one request in flight at a time
    assert slow_proxy.max_in_flight >= 4, slow_proxy.max_in_flight


async def test_a_phase_reads_each_progress_record_once_and_looks_up_no_quarantine_per_task(
        tmp_path: Path, s3_store: S3Server) -> None:
    bucket = s3_store.make_bucket()
    shards = 30
    await PipelineRun(_spec(tmp_path, bucket, s3_store.storage_options, shards)).shard()
    with TcpProxy(s3_store.port) as proxy:
        run = PipelineRun(_spec(tmp_path, bucket, _via(s3_store, proxy.url), shards), InstantRunner())
        await run.infer(0)
        infer = dict(proxy.requests)
        proxy.requests.clear()
        await run.judge(0)
        judge = dict(proxy.requests)
    # infer: a progress record per task and the step's entry; a few listings and reads, none per task
    assert infer["PUT"] == shards + 1, infer
    assert infer.get("GET", 0) + infer.get("HEAD", 0) < 15, infer
    # judge: the infer phase's records read once (the round check uses what the fan-out holds)
    assert judge["PUT"] == shards + 1, judge
    assert shards <= judge.get("GET", 0) < shards + 15 and judge.get("HEAD", 0) < 10, judge
