"""Crash recovery under the real `dagster dev` daemon (a check to run by hand, ~2 min on 2 cores).

Starts `dagster dev` on loopback over a temporary DAGSTER_HOME with the repo's
dagster.yaml, launches a 400-record pipeline run, SIGKILLs the process executing round 0
(the run worker and its step processes) mid-round, and prints how long the daemon's
round sensor took to re-request the step and to finish the run, then the run's
conservation proof. Too slow for the suite (each Dagster run launch costs seconds here);
the suite's proof is ``test_crash_recovery.py``, through the same sensor code.

    .venv/bin/python -m batch_inference_tests.defs.daemon_crash_check [--worker-only] [WORKDIR]

``--worker-only`` kills the run worker alone: its running step process, orphaned, goes
on to finish its step, and the retry must wait until it has exited.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psutil
import yaml

from batch_inference_tests.defs.dagster_dev import DAGSTER, LAUNCH, ROOT, RUNS, default_signals, graphql
from batch_inference_tests.defs.helpers import simulated_spec, write_input
from batch_inference_tests.fixtures.infra import free_port


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if value := predicate():
                return value
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"timed out after {timeout}s waiting for {what}")


def run_worker(step_pid: int) -> psutil.Process:
    """The run's own process: the outermost multiprocessing child above the step (below the code server)."""
    proc = psutil.Process(step_pid)
    for parent in proc.parents():
        if not any("spawn_main" in arg for arg in parent.cmdline()):
            break
        proc = parent
    return proc


def main(work: Path, worker_only: bool) -> None:
    shutil.rmtree(work, ignore_errors=True)
    home = work / "home"
    home.mkdir(parents=True)
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    data = write_input(work / "input.jsonl", 400, prefix="d-")
    spec = simulated_spec("daemon", data, work / "runs", shard_records=50, chunk_size=25, pool={"launcher": "inprocess", "concurrency": 2},
                          engine={"kind": "simulated", "simulated": {"latency_a_s": 0.05, "latency_b_s": 0.0, "approval_rate": 0.6}})
    (work / "spec.yaml").write_text(yaml.safe_dump(spec))
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "BATCH_INFERENCE_POOL_MODE": "inprocess"}
    with (work / "dagster-dev.log").open("wb") as log:
        dev = subprocess.Popen([str(DAGSTER), "dev", "-h", "127.0.0.1", "-p", str(port), "-w", "workspace.yaml"], cwd=ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_signals, start_new_session=True)
        try:
            drive_and_kill(port, work, worker_only)
        finally:
            os.killpg(dev.pid, signal.SIGTERM)
            try:
                dev.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(dev.pid, signal.SIGKILL)
                dev.wait()


def drive_and_kill(port: int, work: Path, worker_only: bool) -> None:
    def runs(job: str) -> list[dict[str, Any]]:
        found = graphql(port, RUNS, {"filter": {"pipelineName": job}})["runsOrError"]["results"]
        return [{**r, "tags": {t["key"]: t["value"] for t in r["tags"]}} for r in found]

    def step_run(key: str, status: str = "SUCCESS") -> bool:
        return any(r["tags"].get("dagster/run_key") == key and r["status"] == status for r in runs("round_job") + runs("results_job"))

    wait(lambda: graphql(port, "{ version }", timeout=5)["version"], 150, "the webserver")
    params = {"selector": {"repositoryLocationName": "batch_inference", "repositoryName": "__repository__", "jobName": "start_pipeline_run"},
              "runConfigData": yaml.safe_dump({"ops": {"start_run": {"config": {"spec_path": str(work / "spec.yaml")}}}})}
    assert graphql(port, LAUNCH, {"params": params})["launchRun"]["__typename"] == "LaunchRunSuccess"
    progress = work / "runs" / "daemon" / "ledger" / "progress" / "round-00-infer"
    wait(lambda: len(list(progress.glob("*.json"))) >= 2, 240, "round 0 progress")
    (round0,) = runs("round_job")
    worker = run_worker(int(round0["tags"]["batch_inference/worker"].split()[1]))
    orphans = worker.children(recursive=True)
    victims = [worker] if worker_only else [worker, *orphans]
    for proc in victims:
        proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    print(f"killed round 0's run worker{'' if worker_only else ' and its step processes'} {[p.pid for p in victims]}"
          f" with 2/8 infer shards done")
    if worker_only:
        wait(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in orphans), 120, "the orphans to exit")
        print(f"its orphaned step processes {[p.pid for p in orphans]} exited {time.monotonic() - killed:.1f}s after the kill")
    wait(lambda: step_run("daemon|r00:retry-1", "STARTED") or step_run("daemon|r00:retry-1"), 120, "the retry")
    print(f"retry daemon|r00:retry-1 running {time.monotonic() - killed:.1f}s after the kill")
    wait(lambda: step_run("daemon|r00:retry-1"), 120, "the retry to succeed")
    print(f"round 0 done (retry SUCCESS) {time.monotonic() - killed:.1f}s after the kill")
    wait(lambda: step_run("daemon:results"), 240, "results")
    print(f"whole run done (results SUCCESS) {time.monotonic() - killed:.1f}s after the kill")
    for job in ("round_job", "tail_job", "results_job"):
        for r in reversed(runs(job)):
            print(f"  {job} {r['status']:8} {r['tags'].get('dagster/run_key')}: {r['tags'].get('batch_inference/reason', '')[:80]}"
                  f" {r['tags'].get('batch_inference/recovery', '')}")
    proof = orjson.loads((work / "runs" / "daemon" / "ledger" / "run.json").read_bytes())["conservation"]
    print(f"conservation ok={proof['ok']} input={proof['input']} terminal={proof['terminal']} missing={proof['missing']} duplicates={proof['duplicate_results']}")
    assert proof["ok"]


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--worker-only"]
    main(Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="daemon-crash-")), "--worker-only" in sys.argv)
