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
import uuid
from pathlib import Path

import dagster as dg
import psutil
import pytest
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
from batch_inference_tests.defs.crash_scenario import sigkill_a_round_run_and_recover


@pytest.mark.slow
def test_a_round_run_sigkilled_mid_round_is_retried_by_the_sensor(tmp_path: Path) -> None:
    home = tmp_path / "dagster-home"
    home.mkdir()
    sigkill_a_round_run_and_recover(tmp_path, home)


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
