"""The SIGKILLed round run the round sensor recovers, on any instance: SQLite in
test_crash_recovery.py, PostgreSQL in test_postgres_instance.py."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import dagster as dg
import orjson

from batch_inference.defs.driver import drive
from batch_inference.defs.recovery import ATTEMPT_TAG, WORKER_TAG
from batch_inference_tests.faults.helpers import RULE_JUDGE, assert_conserved, progress_files, sigkill_after_progress, spot_kill_run

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


def sigkill_a_round_run_and_recover(tmp_path: Path, home: Path) -> None:
    """The end-to-end recovery on the instance configured in ``home`` (SQLite without a dagster.yaml)."""
    from batch_inference.definitions import build_definitions
    from batch_inference.defs.pool.resources import PoolResource
    from batch_inference.defs.storage.resources import StorageResource

    kill = spot_kill_run(tmp_path, run="spot", judge=RULE_JUDGE)
    spec, root, progress = kill.spec, kill.root, kill.progress

    # mid-round: 2 of round 0's 8 infer shards done
    pid, killed_at = sigkill_after_progress([sys.executable, "-c", DRIVER, str(home), str(kill.spec_path)], progress, 2, timeout_s=60)
    done_before = progress_files(progress, "*.json")
    assert 2 <= len(done_before) < kill.shards, "killed mid-round"

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
    assert_conserved(spec, kill.ids)
    assert drive(defs, instance).launched == []  # nothing more to recover: no loop
    print(f"RECOVERY dagster round run SIGKILL: the sensor failed the dead run, retried r00 and finished the run "
          f"{recover_s:.1f}s after the kill (ticks: {result.ticks})")
