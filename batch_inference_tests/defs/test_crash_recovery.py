"""Crash recovery: a SIGKILLed step run is found dead, failed and re-requested by the sensor.

The end-to-end test kills the process executing a round run mid-round and lets the
round sensor (ticked by ``drive``, the daemon's stand-in) finish the pipeline with no
human action; the others pin the rules that keep recovery exact and bounded.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dagster as dg
import orjson
import psutil
import pytest
import yaml
from dagster._core.events import EngineEventData  # what executors record their pids with

from batch_inference.defs.driver import drive
from batch_inference.defs.recovery import (
    ATTEMPT_TAG,
    MAX_ATTEMPTS,
    RECOVERY_TAG,
    RUN_KEY_TAG,
    SENSOR_TAG,
    WORKER_TAG,
    Worker,
    dead_reason,
    recover,
)
from batch_inference.pipeline import PipelineSpec
from batch_inference_tests.faults.helpers import assert_conserved, progress_files, sigkill_after_progress, spec_data, write_input

DRIVER = """
import sys
import dagster as dg
from batch_inference.definitions import build_definitions
from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference.defs.storage.resources import StorageResource

instance = dg.DagsterInstance.from_config(sys.argv[1])  # $DIR/dagster.yaml if any, else SQLite in DIR
defs = build_definitions(pool=PoolResource(mode="inprocess"), storage=StorageResource())
assert start_run(defs, instance, start_run_config(sys.argv[2]), log_level="WARNING").success
drive(defs, instance, log_level="WARNING")
"""



@pytest.mark.slow
def test_a_round_run_sigkilled_mid_round_is_retried_by_the_sensor(tmp_path: Path) -> None:
    home = tmp_path / "dagster-home"
    home.mkdir()
    sigkill_a_round_run_and_recover(tmp_path, home)


def sigkill_a_round_run_and_recover(tmp_path: Path, home: Path) -> None:
    """The end-to-end recovery on the instance configured in ``home`` (SQLite without a dagster.yaml)."""
    from batch_inference.definitions import build_definitions
    from batch_inference.defs.pool.resources import PoolResource
    from batch_inference.defs.storage.resources import StorageResource

    ids = write_input(tmp_path / "input.jsonl", 400)
    data = spec_data(
        tmp_path, run="spot", shard_records=50, chunk_size=25,
        engine={"kind": "simulated", "simulated": {"approval_rate": 0.6, "latency_a_s": 0.03, "latency_b_s": 0.0}},
        judge={"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}},
        pool={"launcher": "inprocess", "concurrency": 2, "retries": 1, "batcher": {"batch_timeout_s": 0.002}},
    )
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    spec = PipelineSpec.load(spec_path)
    root = Path(spec.output) / spec.run
    progress = root / "ledger" / "progress" / "round-00-infer"

    # mid-round: 2 of round 0's 8 infer shards done
    pid, killed_at = sigkill_after_progress([sys.executable, "-c", DRIVER, str(home), str(spec_path)], progress, 2, timeout_s=60)
    done_before = progress_files(progress, "*.json")
    assert 2 <= len(done_before) < 8, "killed mid-round"

    instance = dg.DagsterInstance.from_config(str(home))
    (killed,) = [r for r in instance.get_runs() if r.job_name == "round_job"]
    assert killed.status == dg.DagsterRunStatus.STARTED  # what Dagster alone leaves behind
    assert killed.tags[WORKER_TAG].split()[:2] == [socket.gethostname(), str(pid)]

    # No human action: the daemon's stand-in ticks the real sensor until it stops.
    defs = build_definitions(pool=PoolResource(mode="inprocess"), storage=StorageResource())
    result = drive(defs, instance, log_level="WARNING")
    recover_s = time.monotonic() - killed_at

    keys = [r.run_key for r in result.launched]
    assert keys[0] == "spot|r00:retry-1" and keys[-1] == "spot:results", keys
    assert all(r.success for r in result.launched)
    dead = instance.get_run_by_id(killed.run_id)
    assert dead is not None and dead.status == dg.DagsterRunStatus.FAILURE
    failure = instance.all_logs(killed.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[-1].dagster_event
    assert failure is not None and f"pids [{pid}]" in (failure.message or "")
    retry = instance.get_run_by_id(result.launched[0].run_id)
    assert retry is not None and retry.tags[ATTEMPT_TAG] == "1" and "worker is gone" in retry.tags["batch_inference/reason"]

    after = progress_files(progress, "*.json")
    assert {k: after[k] for k in done_before} == done_before, "finished shards were recomputed"
    run = orjson.loads((root / "ledger" / "run.json").read_bytes())
    assert run["conservation"]["ok"]
    assert_conserved(spec, ids)
    assert drive(defs, instance).launched == []  # nothing more to recover: no loop
    print(f"RECOVERY dagster round run SIGKILL: the sensor failed the dead run, retried r00 and finished the run "
          f"{recover_s:.1f}s after the kill (ticks: {result.ticks})")


# --- the rules, on runs written straight into an instance -----------------------------------


def _run(instance: dg.DagsterInstance, status: dg.DagsterRunStatus, step: str = "x|r00", **tags: str) -> dg.DagsterRun:
    run = dg.DagsterRun(job_name="round_job", run_id=str(uuid.uuid4()), status=status, tags={
        SENSOR_TAG: "round_sensor", RUN_KEY_TAG: step, "dagster/partition": step, **tags})
    return instance.add_run(run)


def _dead_pid() -> tuple[int, float]:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    born = psutil.Process(child.pid).create_time()
    child.wait()
    return child.pid, born


def _recover(instance: dg.DagsterInstance) -> list[dg.RunRequest]:
    context = dg.build_sensor_context(instance=instance, sensor_name="round_sensor")
    return recover(context, "round_sensor", ["round_job"], "batch_inference/run")


@pytest.mark.process
def test_a_process_is_alive_only_if_it_is_the_one_recorded() -> None:
    me = psutil.Process()
    assert Worker(me.pid, me.create_time()).is_alive()
    assert not Worker(me.pid, me.create_time() - 3600).is_alive()  # same pid, a younger process: reused
    pid, born = _dead_pid()
    assert not Worker(pid, born).is_alive()


@pytest.mark.process
def test_a_started_run_is_judged_dead_only_when_every_process_is_gone() -> None:
    instance = dg.DagsterInstance.ephemeral()
    pid, born = _dead_pid()
    here = f"{socket.gethostname()} {pid} {born:.3f}"
    dead = _run(instance, dg.DagsterRunStatus.STARTED, **{WORKER_TAG: here})
    assert "worker is gone" in (dead_reason(instance, dead) or "")

    # a step subprocess still alive (its run worker died): not dead, never started twice
    orphaned = _run(instance, dg.DagsterRunStatus.STARTED, "y|r00", **{WORKER_TAG: here})
    instance.report_engine_event("step subprocess", orphaned, EngineEventData(metadata={"pid": dg.MetadataValue.text(str(os.getpid()))}))
    assert dead_reason(instance, orphaned) is None
    # another host (a Kubernetes pod): not ours to judge; no record yet: cannot judge
    elsewhere = _run(instance, dg.DagsterRunStatus.STARTED, "z|r00", **{WORKER_TAG: f"not-{socket.gethostname()} {pid} {born:.3f}"})
    assert dead_reason(instance, elsewhere) is None
    assert dead_reason(instance, _run(instance, dg.DagsterRunStatus.STARTED, "w|r00")) is None
    assert dead_reason(instance, _run(instance, dg.DagsterRunStatus.STARTED, "v|r00", **{WORKER_TAG: f"{socket.gethostname()} ?"})) is None

    requests = _recover(instance)
    assert [r.run_key for r in requests] == ["x|r00:retry-1"]  # one retry for the step, not two
    assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.FAILURE
    for run in (orphaned, elsewhere):
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED


def test_retries_are_bounded_and_skip_step_failures_and_re_executed_runs() -> None:
    instance = dg.DagsterInstance.ephemeral()
    last = _run(instance, dg.DagsterRunStatus.FAILURE, **{ATTEMPT_TAG: str(MAX_ATTEMPTS), RUN_KEY_TAG: f"x|r00:retry-{MAX_ATTEMPTS}"})
    assert _recover(instance) == []
    assert instance.get_run_by_id(last.run_id).tags[RECOVERY_TAG].startswith("stuck")

    instance = dg.DagsterInstance.ephemeral()
    second = _run(instance, dg.DagsterRunStatus.FAILURE, **{ATTEMPT_TAG: "1", RUN_KEY_TAG: "x|r00:retry-1"})
    assert [(r.run_key, r.tags[ATTEMPT_TAG]) for r in _recover(instance)] == [("x|r00:retry-2", "2")]
    # failed (its run worker died) while one of its step processes still runs: wait for it
    me = psutil.Process()
    orphan = _run(instance, dg.DagsterRunStatus.FAILURE, "y|r00", **{WORKER_TAG: f"{socket.gethostname()} {me.pid} {me.create_time():.3f}"})
    assert [r.run_key for r in _recover(instance)] == ["x|r00:retry-2"]
    assert RECOVERY_TAG not in instance.get_run_by_id(orphan.run_id).tags
    retried = _run(instance, dg.DagsterRunStatus.SUCCESS, **{RUN_KEY_TAG: "x|r00:retry-2"})  # the retry ran
    assert _recover(instance) == []
    assert instance.get_run_by_id(second.run_id).tags[RECOVERY_TAG] == f"superseded by run {retried.run_id}"
