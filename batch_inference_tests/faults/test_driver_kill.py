"""The driver SIGKILLed mid-round: the ``batch-inference run SPEC`` process (the same command
resumes) and the process executing a Dagster round run (re-executing that run resumes).

Finished shards (progress record + committed output) must be neither recomputed nor
duplicated; the shard that was in flight must not be visible half-written.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from batch_inference_tests.faults.helpers import RULE_JUDGE, assert_conserved, progress_files, sigkill_after_progress, spot_kill_run

CLI = [sys.executable, "-m", "batch_inference.cli.main"]


@pytest.mark.slow
def test_driver_sigkilled_mid_round_resumes_without_recompute(tmp_path: Path) -> None:
    kill = spot_kill_run(tmp_path)
    spec, spec_path, root, progress = kill.spec, kill.spec_path, kill.root, kill.progress
    inferred = root / "round-00" / "inferred"

    sigkill_after_progress([*CLI, "run", str(spec_path)], progress, 3, timeout_s=60)  # some of round 0's 8 infer shards done
    done_before = progress_files(progress)
    outputs_before = {k: v for k, v in progress_files(inferred).items()}
    assert 3 <= len(done_before) < kill.shards, "killed mid-round"
    assert not (root / "ledger" / "round-00-infer.json").exists()
    # nothing half-written is visible: every visible inferred shard is complete and readable
    for name in outputs_before:
        assert name.endswith(".jsonl.zst")

    t0 = time.monotonic()
    rerun = subprocess.run([*CLI, "run", str(spec_path)], capture_output=True, timeout=120)
    recover_s = time.monotonic() - t0
    assert rerun.returncode in (0, 3), rerun.stdout.decode()[-3000:] + rerun.stderr.decode()[-3000:]

    # finished shards were not recomputed: their progress records and outputs are untouched
    after = progress_files(progress)
    assert {k: after[k] for k in done_before} == done_before
    outputs_after = progress_files(inferred)
    for name in (n.replace(".json", ".jsonl.zst") for n in done_before):
        assert outputs_after[name] == outputs_before[name], f"{name} was recomputed"
    infer = orjson.loads((root / "ledger" / "round-00-infer.json").read_bytes())
    assert infer["shards_run"] == kill.shards - len(done_before)

    counts = assert_conserved(spec, kill.ids)
    run = orjson.loads((root / "ledger" / "run.json").read_bytes())
    assert run["conservation"]["ok"] and counts["approved"] == run["approved"]
    print(f"RECOVERY driver SIGKILL: re-run finished the remaining {kill.shards - len(done_before)}/{kill.shards} shards of round 0 and the rest in {recover_s:.1f}s")


DAGSTER_DRIVER = """
import sys
import dagster as dg
from batch_inference.definitions import build_definitions
from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference.defs.storage.resources import StorageResource

instance = dg.DagsterInstance.local_temp(tempdir=sys.argv[1])
defs = build_definitions(pool=PoolResource(mode="inprocess"), storage=StorageResource())
assert start_run(defs, instance, start_run_config(sys.argv[2]), log_level="WARNING").success
drive(defs, instance, log_level="WARNING")
"""


@pytest.mark.slow
def test_dagster_run_sigkilled_mid_round_reexecutes_without_recompute(tmp_path: Path) -> None:
    """The process executing a Dagster round run dies; re-executing that run resumes it."""
    import dagster as dg

    from batch_inference.definitions import build_definitions
    from batch_inference.defs.driver import drive
    from batch_inference.defs.pool.resources import PoolResource
    from batch_inference.defs.storage.resources import StorageResource

    kill = spot_kill_run(tmp_path, run="dagster-kill", judge=RULE_JUDGE)
    spec, spec_path, root, progress = kill.spec, kill.spec_path, kill.root, kill.progress
    home = tmp_path / "dagster-home"
    home.mkdir()

    sigkill_after_progress([sys.executable, "-c", DAGSTER_DRIVER, str(home), str(spec_path)], progress, 2, timeout_s=120)
    done_before = progress_files(progress)
    assert 2 <= len(done_before) < kill.shards

    instance = dg.DagsterInstance.local_temp(tempdir=str(home))
    (killed,) = [r for r in instance.get_runs() if r.job_name == "round_job"]
    assert killed.status in (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING)
    defs = build_definitions(pool=PoolResource(mode="inprocess"), storage=StorageResource())
    t0 = time.monotonic()
    # what a person does in the UI: re-execute the dead run (same job, same partition)
    again = defs.resolve_job_def("round_job").execute_in_process(
        instance=instance, partition_key=killed.tags["dagster/partition"], raise_on_error=False,
        run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
    )
    assert again.success
    drive(defs, instance, log_level="WARNING")  # the sensor carries on from the re-executed round
    recover_s = time.monotonic() - t0

    after = progress_files(progress)
    assert {k: after[k] for k in done_before} == done_before, "finished shards were recomputed"
    run = orjson.loads((root / "ledger" / "run.json").read_bytes())
    assert run["conservation"]["ok"]
    assert_conserved(spec, kill.ids)
    print(f"RECOVERY dagster run SIGKILL: re-execution + the rest of the run took {recover_s:.1f}s")
