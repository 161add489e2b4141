"""Whole pipeline runs driven by ticking the real round sensor over an ephemeral instance."""

from __future__ import annotations

import dagster as dg
import pytest
import yaml

from batch_inference.defs.driver import drive, start_run, tick
from batch_inference.defs.keys import APPROVED, REJECTED, RESULTS, SHARDED, SOURCE, TAIL_RETRY
from batch_inference.defs.partitions import ROUND_NUMBERS, RUNS
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout
from batch_inference.storage import JsonlDir
from batch_inference_tests.defs.helpers import check_results, history, latest


def test_multi_round_run_on_the_tiny_model(defs, instance, write_spec, tiny_model_dir):
    """start -> shard -> r00 -> r01 -> r02 (cap) -> results, every step requested by the sensor."""
    spec_path = write_spec("tiny", records=40, max_rounds=3, max_attempts=5,
                           engine={"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"},
                           judge={"kind": "rule", "callable": "regex", "kwargs": {"pattern": "e.*e"}})
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    assert instance.get_dynamic_partitions(RUNS.name) == ["tiny"]

    result = drive(defs, instance)

    assert history(result)[:2] == [("shard_job", "tiny"), ("round_job", "tiny|r00")]
    assert history(result)[-1] == ("results_job", "tiny")
    rounds = [p for job, p in history(result) if job == "round_job"]
    assert rounds == [f"tiny|r{r:02d}" for r in range(len(rounds))] and 2 <= len(rounds) <= 3
    assert all(r.success for r in result.launched)
    assert instance.get_dynamic_partitions(ROUND_NUMBERS.name) == [f"r{r:02d}" for r in range(len(rounds))]

    # Each round's rejected set is the next round's input, and the metadata says so.
    for r in range(len(rounds) - 1):
        rej = latest(instance, REJECTED, f"tiny|r{r:02d}")
        assert rej["decision"] == "next_round"
        pending = latest(instance, dg.AssetKey("pending"), f"tiny|r{r + 1:02d}")
        assert pending["records"] == rej["records"] and pending["from"] == f"rejected[tiny|r{r:02d}]"
    approved = latest(instance, APPROVED, "tiny|r00")
    for key in ("records", "approval_rate", "tokens_in", "tokens_out", "utilization", "avg_fill", "records_per_s", "wall_s"):
        assert key in approved
    assert approved["tokens_in"] > 0 and 0 < approved["approval_rate"] < 1

    res = latest(instance, RESULTS, "tiny")
    spec = PipelineSpec.load(spec_path)
    ledger = Ledger(RunLayout(spec.output, spec.run)).view()
    assert res["records"] == 40 and res["approved"] == ledger.run.approved
    assert res["approved"] + res["exhausted"] == 40 and res["conservation_ok"] is True
    assert "| round 00 -> next_round |" in res["funnel"]
    assert res["dagster/row_count"] == res["approved"] and approved["dagster/row_count"] == approved["records"]
    assert check_results(instance, RESULTS) == {"conservation": True, "no_duplicate_ids": True, "run_quarantine_empty": True,
                                                "approval_floor": True, "structured_output_valid": True}
    assert check_results(instance, REJECTED) == {"round_conservation": True, "review_age": True}

    # Done: more ticks request nothing (run keys are spent, the cursor is past every event).
    again = drive(defs, instance, cursor=result.cursor)
    assert again.launched == [] and again.ticks == 1
    assert drive(defs, instance).launched == []  # even from a fresh cursor: run keys dedupe


def test_tail_handoff(defs, instance, write_spec):
    """Hybrid whose crossover fires after r00: the sensor hands the tail over, then results."""
    spec_path = write_spec("hyb", records=60, strategy="hybrid", approval=0.5, max_attempts=10,
                           crossover={"min_shrink": 1.0, "compare_cost": False, "min_rounds": 1})
    start_run(defs, instance, start_run_config(str(spec_path)))
    result = drive(defs, instance)
    assert history(result) == [("shard_job", "hyb"), ("round_job", "hyb|r00"), ("tail_job", "hyb"), ("results_job", "hyb")]
    assert latest(instance, REJECTED, "hyb|r00")["decision"] == "tail"
    tail = latest(instance, TAIL_RETRY, "hyb")
    assert tail["from_round"] == 1 and tail["records"] == latest(instance, REJECTED, "hyb|r00")["records"]
    run = instance.get_run_by_id(result.launched[2].run_id)
    assert run.run_config["ops"]["tail_retry"]["config"] == {"from_round": 1}
    res = latest(instance, RESULTS, "hyb")
    assert res["tail"] is True and res["approved"] + res["max_attempts"] == 60


def test_in_place_strategy_goes_straight_to_the_tail(defs, instance, write_spec):
    start_run(defs, instance, start_run_config(str(write_spec("inp", records=30, strategy="in_place", max_attempts=8))))
    result = drive(defs, instance)
    assert history(result) == [("shard_job", "inp"), ("tail_job", "inp"), ("results_job", "inp")]
    assert latest(instance, TAIL_RETRY, "inp")["from_round"] == 0


def test_two_runs_side_by_side_and_events_landing_between_ticks(defs, instance, write_spec):
    """Two runs share partitions defs but not keys or paths; several events per tick all count."""
    for name in ("tonight", "yesterday"):
        start_run(defs, instance, start_run_config(str(write_spec(name, records=40))))
    # Both starts land before the first tick: one tick requests both shards.
    first = tick(defs, instance, None)
    assert sorted(r.partition_key for r in first.run_requests) == ["tonight", "yesterday"]
    # Shard both by hand before the next tick: both round-0 requests come in one tick.
    for name in ("tonight", "yesterday"):
        assert defs.resolve_job_def("shard_job").execute_in_process(instance=instance, partition_key=name).success
    second = tick(defs, instance, first.cursor)
    assert sorted(r.run_key for r in second.run_requests) == ["tonight|r00", "yesterday|r00"]
    assert [r.partition_keys for r in second.dynamic_partitions_requests] == [["r00"]]  # the label is shared, added once

    # Nothing was launched for that tick yet: drive from the same cursor (same requests).
    result = drive(defs, instance, cursor=first.cursor)
    assert history(result)[:2] == [("round_job", "tonight|r00"), ("round_job", "yesterday|r00")]
    keys = [p for _, p in history(result)]
    assert keys.count("tonight") == 1 and keys.count("yesterday") == 1  # results, once each
    roots = set()
    for name in ("tonight", "yesterday"):
        res = latest(instance, RESULTS, name)
        assert res["records"] == 40 and res["conservation_ok"]
        roots.add(res["uri"].rsplit("/", 1)[0])
        ids = {rec["id"] for rec in JsonlDir(res["uri"]).iter_records_sync()}
        assert ids and all(i.startswith(f"{name}-") for i in ids)  # each run's results hold only its records
    assert len(roots) == 2


def test_a_failed_round_is_never_advanced(defs, instance, write_spec, monkeypatch):
    """A round whose blocking conservation check fails ends its run; the sensor stops there."""
    from batch_inference.pipeline import PipelineRun
    from batch_inference.storage import JsonlDir

    real_judge = PipelineRun.judge

    async def lossy_judge(self, r):
        summary = await real_judge(self, r)
        shard = JsonlDir(self.layout.rejected(r)).shards()[0]  # a write lost after the judge reported
        shard.fs.rm(shard.path)
        return summary

    monkeypatch.setattr(PipelineRun, "judge", lossy_judge)
    start_run(defs, instance, start_run_config(str(write_spec("broken", records=60, approval=0.3))))
    result = drive(defs, instance)
    assert history(result) == [("shard_job", "broken"), ("round_job", "broken|r00")]
    assert result.launched[1].success is False
    failed_run = instance.get_run_by_id(result.launched[1].run_id)
    assert failed_run.tags["batch_inference/recovery"].startswith("not retried: a step failed")  # no retry either
    assert check_results(instance, REJECTED)["round_conservation"] is False
    assert instance.get_dynamic_partitions(ROUND_NUMBERS.name) == ["r00"]  # r01 never added
    assert not instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=RESULTS, asset_partitions=["broken"]), limit=1).records


def test_starting_a_run_twice_is_refused(defs, instance, write_spec):
    path = str(write_spec("once", records=5))
    assert start_run(defs, instance, start_run_config(path)).success
    with pytest.raises(dg.Failure, match="already started"):
        start_run(defs, instance, start_run_config(path))
    assert start_run(defs, instance, start_run_config(path, run="once-again")).success  # a new name is a new run
    spec = latest(instance, SOURCE, "once-again")["spec"]
    assert spec["run"] == "once-again" and yaml.safe_dump(spec)


def test_a_start_step_executed_again_by_its_own_run_is_not_a_second_start(defs, instance, write_spec):
    # a run pod killed after the step recorded source_dataset, then resumed by run monitoring
    # (the same Dagster run executing its step again): refused as "already started", the run
    # failed on Kubernetes (k8s/test_real_pods.py's SIGKILLed run pod found it)
    from batch_inference.defs.keys import DEFAULT
    from batch_inference.defs.runs.start import already_started

    first = start_run(defs, instance, start_run_config(str(write_spec("resumed", records=5))))
    assert first.success
    assert not already_started(instance, DEFAULT, "resumed", by_run_id=first.run_id)  # its own start
    assert already_started(instance, DEFAULT, "resumed", by_run_id="another-run")  # anybody else's is refused
    assert already_started(instance, DEFAULT, "resumed")


def test_the_start_job_records_the_plan_and_rounds_show_eta_and_planned_wall(defs, instance, write_spec):
    path = str(write_spec("planned", records=40))
    assert start_run(defs, instance, start_run_config(path)).success
    meta = latest(instance, SOURCE, "planned")
    assert meta["plan.records"] == 40 and meta["plan.wall_s"] > 0 and "plan.error" not in meta
    assert "approval per attempt" in meta["plan.assumptions"]
    # what the figures are for, and no planned wall for a phase nobody priced (issue 28 item 4)
    assert meta["plan.basis"].startswith("priced for: ") and "the spec's engine: " in meta["plan.basis"]
    assert "plan.phase.round 0 infer.wall_s" in meta and not any(k.startswith("plan.phase.shard") for k in meta), sorted(meta)
    drive(defs, instance)
    rejected = latest(instance, REJECTED, "planned|r00")
    assert rejected["planned_run_wall_s"] == pytest.approx(meta["plan.wall_s"], abs=0.06)  # metadata rounds to 0.1 s
    assert rejected["eta_run_s"] >= 0 and rejected["decision_figures"]["eta_run_s"] == rejected["eta_run_s"]


def test_steps_of_an_unstarted_run_name_the_fix(defs, instance):
    instance.add_dynamic_partitions(RUNS.name, ["ghost"])
    result = defs.resolve_job_def("shard_job").execute_in_process(instance=instance, partition_key="ghost", raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    error = failure.step_failure_data.error
    assert error.cause.cls_name == "SpecNotFound" and "start_pipeline_run" in error.cause.message
    assert not instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=SHARDED, asset_partitions=["ghost"]), limit=1).records


@pytest.mark.process
def test_the_daemon_resolves_the_sensors_requests(defs, write_spec, tmp_path):
    """Dagster's own tick evaluation (what the daemon runs) accepts every request: the new
    round label in the same result makes ``<run>|r00`` a valid partition of round_job."""
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(tempdir=str(tmp_path / "home")) as instance:
        start_run(defs, instance, start_run_config(str(write_spec("daemon", records=10))))
        assert defs.resolve_job_def("shard_job").execute_in_process(instance=instance, partition_key="daemon").success
        sensor = defs.resolve_sensor_def("round_sensor")
        resources = {k: v for k, v in (defs.resources or {}).items() if k in sensor.required_resource_keys}  # not the IO manager
        context = dg.build_sensor_context(instance_ref=instance.get_ref(), definitions=defs, sensor_name="round_sensor",
                                          resources=resources)
        data = sensor.evaluate_tick(context)
        assert [(r.job_name, r.partition_key) for r in data.run_requests] == [
            ("shard_job", "daemon"), ("round_job", "daemon|r00")]
        assert data.run_requests[1].tags["dagster/partition/pipeline"] == "daemon"
        assert data.run_requests[1].tags["dagster/partition/round"] == "r00"


def test_a_round_materialised_twice_gets_one_follow_up(defs, instance, write_spec):
    start_run(defs, instance, start_run_config(str(write_spec("twice", records=20))))
    instance.add_dynamic_partitions(ROUND_NUMBERS.name, ["r00"])
    assert defs.resolve_job_def("shard_job").execute_in_process(instance=instance, partition_key="twice").success
    for _ in range(2):  # round 0 materialised twice (a manual re-run) before the sensor ticks
        assert defs.resolve_job_def("round_job").execute_in_process(instance=instance, partition_key="twice|r00").success
    keys = [r.run_key for r in tick(defs, instance, None).run_requests]
    assert keys == ["twice:shard", "twice|r00", "twice|r01"]


def test_the_sharded_asset_accounts_for_every_input_line(defs, instance, write_spec, tmp_path):
    """A run launched through Dagster says what the CLI says (``pipeline.accounting``): the
    input's lines, the malformed ones by file:line, and the repeated ids, on the sharded asset."""
    spec_path = write_spec("acct", records=30)
    src = tmp_path / "inputs" / "acct.jsonl"
    with src.open("ab") as f:
        f.write(b'{"id": "broken", \n[1, 2]\n{"id": "acct-0003", "prompt": "again"}\n')  # lines 31, 32; 33 repeats an id
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    drive(defs, instance)
    meta = latest(instance, SHARDED, "acct")
    assert meta["input_lines"] == 33 and meta["malformed"] == 2 and meta["records"] == 31, meta
    assert f"{src}:31, {src}:32" in meta["input_warnings"] and "'acct-0003'" in meta["input_warnings"], meta


def test_a_running_tail_step_shows_its_progress_in_dagster(defs, instance, write_spec, monkeypatch):
    """While the tail's one shard runs (chunks of 5, a 0.05 s call each), its Dagster run logs its
    tasks' per-chunk progress and tags the run with the latest (``batch_inference/progress``):
    before, nothing showed until the step's materialisation at its end."""
    from batch_inference.defs import steps

    monkeypatch.setattr(steps, "PROGRESS_EVERY_S", 0.2)
    slow = {"kind": "simulated", "simulated": {"latency_a_s": 0.05, "latency_b_s": 0.0, "approval_rate": 1.0}}
    path = write_spec("live", records=100, strategy="in_place", max_attempts=1, engine=slow, shard_records=100, chunk_size=5,
                      pool={"launcher": "inprocess", "concurrency": 1})
    start_run(defs, instance, start_run_config(str(path)))
    result = drive(defs, instance)
    tail_run = next(r for r in result.launched if r.job_name == "tail_job")
    logged = [e.message for e in instance.all_logs(tail_run.run_id) if e.message and "tail under way" in e.message]
    assert logged, "no progress was logged while the tail ran"
    through = [int(m.split(" record(s) through")[0].rsplit(" ", 1)[-1].replace(",", "")) for m in logged]
    assert any(0 < n < 100 for n in through) and through == sorted(through)  # moved within the one shard
    assert "settled so far: approved" in instance.get_run_by_id(tail_run.run_id).tags["batch_inference/progress"]
