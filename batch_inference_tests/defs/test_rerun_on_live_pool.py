"""Materialise, wipe, materialise again, with the GPU steps on one persistent pool left up:
the workers must not answer the second materialisation from the first one's memory."""

from __future__ import annotations

import shutil

import dagster as dg
import pytest

from batch_inference.definitions import build_definitions
from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.keys import RESULTS
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference.defs.storage.resources import StorageResource

pytestmark = pytest.mark.slow

ENGINE = {"kind": "simulated", "simulated": {"approval_rate": 1.0, "latency_a_s": 0.0, "latency_b_s": 0.0}}
RECORDS = 80


def results(instance: dg.DagsterInstance, run: str) -> dict:
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=RESULTS, asset_partitions=[run]), limit=1).records
    assert recs, f"no results[{run}]"
    return {k: v.value for k, v in recs[0].asset_materialization.metadata.items()}


def test_materialise_wipe_and_materialise_again_on_a_pool_left_up(local_pool, instance, write_spec, tmp_path) -> None:
    launcher = local_pool(engine_config=ENGINE, replicas=1, concurrency=4)
    (worker,) = launcher.status()
    defs = build_definitions(pool=PoolResource(mode="endpoints", endpoints=launcher.endpoints()), storage=StorageResource())
    spec = write_spec("wiped", records=RECORDS)
    start_run(defs, instance, start_run_config(str(spec)))
    first = drive(defs, instance)
    assert [r.job_name for r in first.launched] == ["shard_job", "round_job", "results_job"]
    assert all(r.success for r in first.launched), [r.error for r in first.launched]
    assert results(instance, "wiped")["approved"] == RECORDS

    # 1. wipe the run's storage, materialise its assets again by hand (same instance, same spec)
    shutil.rmtree(tmp_path / "runs" / "wiped")
    for job, partition in (("shard_job", "wiped"), ("round_job", "wiped|r00"), ("results_job", "wiped")):
        done = defs.resolve_job_def(job).execute_in_process(instance=instance, partition_key=partition, raise_on_error=False)
        assert done.success, f"{job}[{partition}] after the wipe failed"
    again = results(instance, "wiped")
    assert again["approved"] == RECORDS and again["conservation_ok"]

    # 2. the Dagster instance and the storage wiped, the template edited: the same run name starts afresh
    shutil.rmtree(tmp_path / "runs" / "wiped")
    fresh = dg.DagsterInstance.ephemeral()
    edited = write_spec("wiped", records=RECORDS, infer={"template": "Reply briefly: {prompt}", "sampling": {"max_tokens": 8}})
    start_run(defs, fresh, start_run_config(str(edited)))
    second = drive(defs, fresh)
    assert all(r.success for r in second.launched), [r.error for r in second.launched]
    edited_results = results(fresh, "wiped")
    assert edited_results["approved"] == RECORDS and edited_results["conservation_ok"]  # never quarantined by a 409
    assert [w.pid for w in launcher.status() if w.healthy] == [worker.pid]  # one pool served all three
