"""The S3 store unreachable mid-round: for a few seconds (recovered), for good, and restarted.

Each outage row runs against moto and against SeaweedFS (``s3_store``: a real object
store, ``make test-infra``). The run talks to the server through a :class:`TcpProxy`;
cutting the proxy refuses and resets connections exactly like a server outage. The
restart row needs a server that keeps its data: SeaweedFS is SIGKILLed mid-round and
started again on the same data directory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.storage import JsonlFile
from batch_inference_tests.faults.helpers import assert_conserved, spec_data
from batch_inference_tests.faults.tcp_proxy import TcpProxy
from batch_inference_tests.fixtures.s3 import S3Server
from batch_inference_tests.fixtures.seaweedfs import SeaweedServer

ENGINE: dict[str, Any] = {"kind": "simulated", "simulated": {"approval_rate": 0.6, "latency_a_s": 0.01, "latency_b_s": 0.0}}


@pytest.fixture
def proxy(s3_store: S3Server) -> Iterator[TcpProxy]:
    with TcpProxy(s3_store.port) as p:
        yield p


def _options(server: S3Server, endpoint: str, **extra: Any) -> dict[str, Any]:
    return {**server.storage_options, "client_kwargs": {"endpoint_url": endpoint}, **extra}


def _s3_spec(
    tmp_path: Path, server: S3Server, bucket: str, endpoint: str, n: int, strategy: str = "rounds", **options: Any
) -> tuple[PipelineSpec, list[str]]:
    ids = [f"s{i:05d}" for i in range(n)]
    with JsonlFile(f"{bucket}/input/data.jsonl", storage_options=server.storage_options).writer_sync() as w:
        w.write_many({"id": rid, "prompt": f"question {rid}"} for rid in ids)
    data = spec_data(
        tmp_path, input=f"{bucket}/input/data.jsonl", engine=ENGINE, output=f"{bucket}/runs", strategy=strategy,
        storage_options=_options(server, endpoint, **options), max_rounds=1, shard_records=30,
        pool={"concurrency": 2, "retries": 2, "storage_options_ref": "s3", "batcher": {"batch_timeout_s": 0.002}},
    )
    return PipelineSpec.parse(data), ids


def _progress(server: S3Server, bucket: str, spec: PipelineSpec) -> int:
    """Finished shards of the first phase, read directly from the server (not via the proxy)."""
    fs = JsonlFile(f"{bucket}/x", storage_options=server.storage_options).fs
    fs.invalidate_cache()
    step = "tail" if spec.strategy == "in_place" else "round-00-infer"
    path = f"{bucket[5:]}/runs/{spec.run}/ledger/progress/{step}"
    try:
        return len(fs.ls(path, detail=False))
    except FileNotFoundError:
        return 0


async def _wait_progress(server: S3Server, bucket: str, spec: PipelineSpec, run: asyncio.Task[Any], at_least: int) -> None:
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(_progress, server, bucket, spec) < at_least:
        assert not run.done(), f"the run ended before the outage: {run.exception() if run.done() else ''}"
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["rounds", "in_place"])
async def test_s3_unreachable_for_seconds_mid_round_recovers(
    tmp_path: Path, s3_store: S3Server, s3_store_bucket: str, proxy: TcpProxy, strategy: str
) -> None:
    spec, ids = _s3_spec(tmp_path, s3_store, s3_store_bucket, proxy.url, 120, strategy=strategy)
    run = asyncio.create_task(run_pipeline(spec))
    await _wait_progress(s3_store, s3_store_bucket, spec, run, 1)
    await asyncio.to_thread(proxy.cut)
    cut_at = time.monotonic()
    await asyncio.sleep(3.0)
    await asyncio.to_thread(proxy.restore)
    summary = await asyncio.wait_for(run, 120)
    recovered_s = time.monotonic() - cut_at
    assert summary.failed == 0 and summary.status in ("converged", "exhausted")
    assert summary.conservation["ok"]
    assert_conserved(spec, ids)
    print(f"RECOVERY s3 outage 3s ({strategy}): run finished {recovered_s:.1f}s after the cut")


@pytest.mark.slow
async def test_s3_gone_for_good_names_the_url_and_a_rerun_completes(
    tmp_path: Path, s3_store: S3Server, s3_store_bucket: str, proxy: TcpProxy
) -> None:
    # botocore's own retries shortened (2 attempts) so that giving up takes ~1 s, not ~30 s
    spec, ids = _s3_spec(tmp_path, s3_store, s3_store_bucket, proxy.url, 120, config_kwargs={"retries": {"max_attempts": 2}})
    run = asyncio.create_task(run_pipeline(spec, retries=1, backoff_s=0.2))
    await _wait_progress(s3_store, s3_store_bucket, spec, run, 1)
    await asyncio.to_thread(proxy.cut)
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        await asyncio.wait_for(run, 120)
    failed_after_s = time.monotonic() - t0
    message = f"{type(info.value).__name__}: {info.value}"
    assert proxy.url in message or f"127.0.0.1:{proxy.port}" in message, message
    # nothing half-written is visible: every committed object is a complete shard
    fs = JsonlFile(f"{s3_store_bucket}/x", storage_options=s3_store.storage_options).fs
    fs.invalidate_cache()
    for path in fs.find(f"{s3_store_bucket[5:]}/runs/{spec.run}"):
        if path.endswith(".jsonl.zst"):
            sum(1 for _ in JsonlFile(f"s3://{path}", storage_options=s3_store.storage_options).iter_records_sync())
        elif path.endswith(".json"):
            orjson.loads(fs.cat_file(path))
    # no shard was quarantined for an outage that is not the data's fault
    assert not [p for p in fs.find(f"{s3_store_bucket[5:]}/runs/{spec.run}") if "/failed/" in p]
    await asyncio.to_thread(proxy.restore)
    summary = await run_pipeline(spec)
    assert summary.failed == 0 and summary.conservation["ok"]
    assert_conserved(spec, ids)
    print(f"RECOVERY s3 gone: clear error after {failed_after_s:.1f}s: {message[:300]}")


def _progress_stamps(server: S3Server, bucket: str, spec: PipelineSpec) -> dict[str, str]:
    """Progress record -> LastModified, read directly from the server: which shards were (re)written when."""
    fs = JsonlFile(f"{bucket}/x", storage_options={**server.storage_options, "skip_instance_cache": True}).fs
    path = f"{bucket[5:]}/runs/{spec.run}/ledger/progress/round-00-infer"
    try:
        return {p["name"]: str(p["LastModified"]) for p in fs.ls(path, detail=True)}
    except FileNotFoundError:
        return {}


@pytest.mark.slow
@pytest.mark.infra
async def test_s3_server_crash_restart_mid_round_keeps_data_and_the_run_completes(tmp_path: Path, seaweedfs: SeaweedServer) -> None:
    # moto would come back empty; SeaweedFS comes back with everything committed before the crash
    bucket = seaweedfs.make_bucket()
    spec, ids = _s3_spec(tmp_path, seaweedfs, bucket, seaweedfs.endpoint_url, 120)
    run = asyncio.create_task(run_pipeline(spec))
    await _wait_progress(seaweedfs, bucket, spec, run, 1)
    before = await asyncio.to_thread(_progress_stamps, seaweedfs, bucket, spec)
    restart_s = await asyncio.to_thread(seaweedfs.restart, kill=True)
    summary = await asyncio.wait_for(run, 180)
    assert summary.failed == 0 and summary.conservation["ok"] and summary.status in ("converged", "exhausted")
    assert_conserved(spec, ids)
    after = await asyncio.to_thread(_progress_stamps, seaweedfs, bucket, spec)
    assert before and {k: after[k] for k in before} == before, "shards finished before the crash were recomputed"
    print(f"RECOVERY s3 server SIGKILLed and restarted ({restart_s:.1f}s): the run completed, "
          f"{len(before)} shard(s) finished before the crash kept, not recomputed")
