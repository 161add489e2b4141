"""With `dagster: {home: DIR}` each batch runs as Dagster runs of its model's pipeline on that
instance: the official `openai` SDK against `batch-inference api serve`, then the instance read as
`dagster dev` over the same DAGSTER_HOME would."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import dagster as dg
import pytest

from batch_inference.api.dagster_runs import pipeline_keys
from batch_inference_tests.api.helpers import (chat_line, client, delivered, serving, slow_model, start, submit, wait_for,
                                               wait_status, write_config)

pytestmark = [pytest.mark.process, pytest.mark.slow]


def test_each_batch_is_a_dagster_run_of_the_pipeline_with_its_lineage(tmp_path: Path) -> None:
    home = tmp_path / "dagster_home"
    config = write_config(tmp_path, dagster={"home": "./dagster_home"})
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(25)] + [chat_line("bad", "x", model="nope")]
    with serving(config) as server:
        c = client(server)
        batch = submit(c, lines)
        done = wait_status(c, batch.id, ("completed", "failed"))
        assert done.status == "completed", (done.errors, server.log.read_text()[-3000:])
        out, err = delivered(c, done)
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(25))
    assert [x["custom_id"] for x in err] == ["bad"]

    k = pipeline_keys("tiny")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs()
        by_job = {}
        for r in runs:
            by_job.setdefault(r.job_name, []).append(r)
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [(r.job_name, r.status) for r in runs]
        assert k.name("start_pipeline_run") in by_job and k.name("shard_job") in by_job, sorted(by_job)
        assert k.name("tail_job") in by_job and k.name("results_job") in by_job, sorted(by_job)
        results_run = by_job[k.name("results_job")][0]
        assert results_run.tags.get("dagster/partition") == batch.id
        for key in (k.source, k.sharded, k.tail_retry, k.results):
            mats = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[batch.id]), limit=5)
            assert len(mats.records) == 1, key
        # the start prices nothing for a batch (no plan before its first shard): the server estimates its finish itself
        source = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=k.source, asset_partitions=[batch.id]), limit=1)
        started = source.records[0].asset_materialization
        assert started is not None and "preflight" in started.metadata
        assert not [name for name in started.metadata if name.startswith("plan")], sorted(started.metadata)
        checks = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(k.results, "conservation"), limit=5)
        assert checks and checks[0].status.value == "SUCCEEDED"


def test_cancel_under_dagster_delivers_what_finished(tmp_path: Path) -> None:
    config = write_config(tmp_path, slow_model(), dagster={"home": "./dagster_home"})
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(300)]
    with serving(config) as server:
        c = client(server)
        batch = submit(c, lines)
        wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 20, what="progress")
        c.batches.cancel(batch.id)
        done = wait_status(c, batch.id, ("cancelled",))
        out, err = delivered(c, done)
    assert 0 < len(out) < 300 and {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert len(out) + len(err) == 300
    k = pipeline_keys("tiny")
    with dg.DagsterInstance.from_config(str(tmp_path / "dagster_home")) as instance:
        tail = [r for r in instance.get_runs() if r.job_name == k.name("tail_job")]
        assert [r.status for r in tail] == [dg.DagsterRunStatus.FAILURE]  # the stopped step ended its run
        assert not instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=k.results, asset_partitions=[batch.id]),
                                                   limit=1).records


def test_sigkill_under_dagster_then_restart_resumes_in_dagster(tmp_path: Path) -> None:
    config = write_config(tmp_path, slow_model(), dagster={"home": "./dagster_home"})
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(200)]
    server = start(config)
    try:
        c = client(server)
        batch = submit(c, lines)
        wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 30, what="progress")
        server.stop(signal.SIGKILL)
    finally:
        server.stop(signal.SIGKILL)
    with serving(config) as again:
        c = client(again)
        done = wait_status(c, batch.id, ("completed",))
        out, err = delivered(c, done)
    assert not err and sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    k = pipeline_keys("tiny")
    with dg.DagsterInstance.from_config(str(tmp_path / "dagster_home")) as instance:
        tail = sorted((r for r in instance.get_runs() if r.job_name == k.name("tail_job")), key=lambda r: r.tags["dagster/run_key"])
        # the killed server's run is marked failed (defs.recovery), and its retry finished the step
        assert [r.status for r in tail] == [dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.SUCCESS], \
            [(r.tags.get("dagster/run_key"), r.status) for r in tail]
        assert instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=k.results, asset_partitions=[batch.id]),
                                               limit=1).records


def test_a_judged_batch_runs_its_rounds_and_tail_as_dagster_runs(tmp_path: Path) -> None:
    engine = {"kind": "simulated", "simulated": {"approval_rate": 0.5, "latency_a_s": 0.002, "latency_b_s": 0.0, "output_tokens": 4}}
    model = {"engine": engine, "judge": {"kind": "llm", "template": "Judge this answer: {result}"}, "strategy": "hybrid",
             "max_rounds": 4, "max_attempts": 4, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5}
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(60)]
    with serving(write_config(tmp_path, {"tiny": model}, dagster={"home": "./dagster_home"})) as server:
        c = client(server)
        done = wait_status(c, submit(c, lines).id, ("completed", "failed"))
        assert done.status == "completed", (done.errors, server.log.read_text()[-3000:])
        out, err = delivered(c, done)
    assert sorted(x["custom_id"] for x in out + err) == sorted(x["custom_id"] for x in lines)
    k = pipeline_keys("tiny")
    with dg.DagsterInstance.from_config(str(tmp_path / "dagster_home")) as instance:
        runs = instance.get_runs()
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [(r.job_name, r.status) for r in runs]
        rounds = sorted(r.tags["dagster/partition"] for r in runs if r.job_name == k.name("round_job"))
        assert rounds and rounds[0] == f"{done.id}|r00", rounds
        assert {r.job_name for r in runs} >= {k.name("results_job")}
        assert instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=k.results, asset_partitions=[done.id]),
                                               limit=1).records
