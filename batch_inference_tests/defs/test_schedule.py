"""The cron schedule starts a run over the night's drop; the sensor then drives it."""

from __future__ import annotations

import datetime as dt

import dagster as dg

from batch_inference.defs.driver import drive
from batch_inference.defs.keys import RESULTS, SOURCE
from batch_inference.defs.runs.schedules import build_pipeline_schedule
from batch_inference_tests.defs.helpers import write_input


def test_schedule_tick_starts_a_run_the_sensor_finishes(defs, instance, write_spec, tmp_path):
    spec_path = write_spec("base", records=10)
    drop = write_input(tmp_path / "drops" / "20261129" / "prompts.jsonl", 25, prefix="night-")
    schedule = build_pipeline_schedule(str(spec_path), cron_schedule="0 2 * * *",
                                       input_template=str(tmp_path / "drops" / "{date}" / "prompts.jsonl"))
    when = dt.datetime(2026, 11, 29, 2, 0, tzinfo=dt.timezone.utc)
    with dg.build_schedule_context(instance=instance, scheduled_execution_time=when) as context:
        request = schedule.evaluate_tick(context).run_requests[0]
    assert request.run_key == "nightly-20261129"
    assert request.run_config["ops"]["start_run"]["config"] == {
        "spec_path": str(spec_path), "run": "nightly-20261129", "input": str(drop)}

    started = defs.resolve_job_def(schedule.job_name).execute_in_process(
        run_config=request.run_config, instance=instance, tags=request.tags)
    assert started.success
    source = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=SOURCE, asset_partitions=["nightly-20261129"]), limit=1).records[0]
    assert source.asset_materialization.metadata["spec"].value["input"] == str(drop)

    result = drive(defs, instance)
    assert [r.job_name for r in result.launched][0] == "shard_job" and result.launched[-1].job_name == "results_job"
    res = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=RESULTS, asset_partitions=["nightly-20261129"]), limit=1)
    assert res.records[0].asset_materialization.metadata["records"].value == 25  # the drop, not the spec's own input


def test_schedule_skips_without_a_spec(instance, tmp_path):
    schedule = build_pipeline_schedule(str(tmp_path / "missing.yaml"))
    with dg.build_schedule_context(instance=instance, scheduled_execution_time=dt.datetime(2026, 1, 1, 2)) as context:
        data = schedule.evaluate_tick(context)
    assert not data.run_requests and "does not exist" in data.skip_message
