"""The in-process pool's tasks read and write S3 with the spec's credentials.

The store requires them (moto with an IAM user: ``make test``; SeaweedFS with its one
identity: ``make test-infra``), so a task that went without them fails at its first read
and its shard would be quarantined.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.storage import JsonlFile
from batch_inference_tests.faults.helpers import spec_data
from batch_inference_tests.fixtures.s3 import S3Server

ENGINE = {"kind": "simulated", "simulated": {"approval_rate": 0.7, "latency_a_s": 0.0, "latency_b_s": 0.0}}


@pytest.mark.parametrize("strategy", ["rounds", "in_place"])
async def test_inprocess_tasks_use_the_specs_storage_options_without_a_profile_name(
    tmp_path: Path, s3_store: S3Server, s3_store_bucket: str, strategy: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)  # no ambient credentials to fall back on
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    src = f"{s3_store_bucket}/input/data.jsonl"
    with JsonlFile(src, storage_options=s3_store.storage_options).writer_sync() as w:
        w.write_many({"id": f"s{i:04d}", "prompt": f"question {i}"} for i in range(60))
    spec = PipelineSpec.parse(spec_data(
        tmp_path, input=src, output=f"{s3_store_bucket}/runs", engine=ENGINE, strategy=strategy,
        storage_options=s3_store.storage_options, max_rounds=2, max_attempts=3, shard_records=20,
        pool={"launcher": "inprocess", "concurrency": 2, "retries": 0},  # no storage_options_ref
    ))
    summary = await run_pipeline(spec, retries=0)
    assert summary.quarantined == 0, summary
    assert summary.conservation["ok"] and summary.records == 60
    assert summary.approved > 0
