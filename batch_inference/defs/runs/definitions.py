"""The runs domain's definitions: a pipeline run as a whole, from its start to its results.

The nightly schedule is configured by the arguments, else the environment:

    BATCH_INFERENCE_SCHEDULE_SPEC    spec file the schedule starts (default .demo/spec.yaml)
    BATCH_INFERENCE_SCHEDULE_CRON    its cron, UTC (default "0 2 * * *")
    BATCH_INFERENCE_SCHEDULE_INPUT   its input URL template, e.g. s3://drops/{date}/prompts.jsonl
"""

from __future__ import annotations

import os

import dagster as dg

from batch_inference.defs.jobs import results_job, shard_job, tail_job
from batch_inference.defs.runs.assets import openai_batch_export, parquet_export, results, sharded, source_dataset, tail_retry
from batch_inference.defs.runs.checks import run_checks
from batch_inference.defs.runs.jobs import start_pipeline_run
from batch_inference.defs.runs.schedules import build_pipeline_schedule


def build_definitions(
    *, schedule_spec: str | None = None, schedule_cron: str | None = None, schedule_input: str | None = None,
    env: os._Environ[str] | dict[str, str] = os.environ,
) -> dg.Definitions:
    """Assets, checks, jobs and the nightly schedule of a pipeline run."""
    schedule = build_pipeline_schedule(
        schedule_spec or env.get("BATCH_INFERENCE_SCHEDULE_SPEC") or os.path.abspath(".demo/spec.yaml"),
        cron_schedule=schedule_cron or env.get("BATCH_INFERENCE_SCHEDULE_CRON", "0 2 * * *"),
        input_template=schedule_input or env.get("BATCH_INFERENCE_SCHEDULE_INPUT") or None,
    )
    return dg.Definitions(
        assets=[source_dataset, sharded, tail_retry, results, openai_batch_export, parquet_export],
        asset_checks=[run_checks],
        jobs=[start_pipeline_run, shard_job, tail_job, results_job],
        schedules=[schedule],
    )
