"""`dagster dev` serves the project: the asset graph over GraphQL, a launched run, the live sensor.

Starts the real webserver + daemon on 127.0.0.1 (free port, DAGSTER_HOME in tmp) and
stops it by process group. SIGINT/SIGTERM are reset to their defaults in the child:
started from a non-interactive shell, `dagster dev` otherwise ignores SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
import yaml

from batch_inference_tests.defs.dagster_dev import DAGSTER, LAUNCH, ROOT, RUNS, default_signals, graphql, wait_for
from batch_inference_tests.fixtures.infra import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def dagster_dev(tmp_path, write_spec):
    if not DAGSTER.exists():
        pytest.skip("no .venv/bin/dagster")
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "BATCH_INFERENCE_POOL_MODE": "inprocess",
           "BATCH_INFERENCE_SCHEDULE_SPEC": str(write_spec("scheduled", records=5))}
    log = (tmp_path / "dagster-dev.log").open("wb")
    proc = subprocess.Popen(
        [str(DAGSTER), "dev", "-h", "127.0.0.1", "-p", str(port), "-w", "workspace.yaml"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_signals, start_new_session=True,
    )
    try:
        wait_for(lambda: graphql(port, "{ version }", timeout=5).get("version"), 150, "the webserver", proc)
        yield port, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


ASSET_GRAPH = "{ assetNodes { assetKey { path } dependencyKeys { path } isPartitioned jobNames } }"
def test_dagster_dev_serves_the_asset_graph_and_runs_it(dagster_dev, write_spec):
    port, proc = dagster_dev
    nodes = graphql(port, ASSET_GRAPH)["assetNodes"]
    deps = {"/".join(n["assetKey"]["path"]): {"/".join(d["path"]) for d in n["dependencyKeys"]} for n in nodes}
    assert deps["sharded"] == {"source_dataset"}
    assert deps["pending"] == {"sharded"} and deps["inferred"] == {"pending"}
    assert deps["approved"] == {"inferred"} and deps["rejected"] == {"inferred"}
    assert {"approved", "failed", "tail_retry"} <= deps["results"]
    assert all(n["isPartitioned"] for n in nodes)

    spec_path = write_spec("viaui", records=12)
    params = {
        "selector": {"repositoryLocationName": "batch_inference", "repositoryName": "__repository__",
                     "jobName": "start_pipeline_run"},
        "runConfigData": yaml.safe_dump({"ops": {"start_run": {"config": {"spec_path": str(spec_path)}}}}),
    }
    launched = graphql(port, LAUNCH, {"params": params})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched

    def status_of(job: str) -> str | None:
        runs = graphql(port, RUNS, {"filter": {"pipelineName": job}})["runsOrError"]["results"]
        return runs[0]["status"] if runs else None

    assert wait_for(lambda: status_of("start_pipeline_run") in ("SUCCESS", "FAILURE"), 120, "the start run", proc) is True
    assert status_of("start_pipeline_run") == "SUCCESS"
    # The daemon's round sensor (running by default) takes over: it launches the shard step.
    wait_for(lambda: status_of("shard_job") == "SUCCESS", 150, "the sensor-launched shard run", proc)
    shard = graphql(port, RUNS, {"filter": {"pipelineName": "shard_job"}})["runsOrError"]["results"][0]
    tags = {t["key"]: t["value"] for t in shard["tags"]}
    assert tags["dagster/partition"] == "viaui" and tags["dagster/sensor_name"] == "round_sensor"


def test_make_dev_serves_on_the_port_it_is_given(tmp_path):
    """`make dev PORT=N` serves the UI on N (it was hard-coded to 3000: issue 28 item 6).

    Runs the Makefile's own target; ``-o`` keeps make from rebuilding the venv (the target's
    prerequisite), so the test never installs anything."""
    if not DAGSTER.exists() or shutil.which("make") is None:
        pytest.skip("no .venv/bin/dagster or no make")
    venv = DAGSTER.parent.parent
    port = free_port()
    log = (tmp_path / "make-dev.log").open("wb")
    proc = subprocess.Popen(
        ["make", "-o", str(venv / ".installed"), "dev", f"PORT={port}", f"VENV={venv}", f"DAGSTER_HOME={tmp_path / 'home'}"],
        cwd=ROOT, env={**os.environ, "BATCH_INFERENCE_POOL_MODE": "inprocess"}, stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=default_signals, start_new_session=True,
    )
    try:
        assert wait_for(lambda: graphql(port, "{ version }", timeout=5).get("version"), 150, f"the webserver on {port}", proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()
