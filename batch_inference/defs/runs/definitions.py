"""The runs domain's definitions: a pipeline run as a whole, from its start to its results.

The project's own pipeline's schedule is configured by the arguments, else the environment:

    BATCH_INFERENCE_SCHEDULE_SPEC    spec file the schedule (and source_dataset) starts (default .demo/spec.yaml)
    BATCH_INFERENCE_SCHEDULE_CRON    its cron, UTC (default "0 2 * * *")
    BATCH_INFERENCE_SCHEDULE_INPUT   its input URL template, e.g. s3://drops/{date}/prompts.jsonl

A component's pipeline gets its schedule from its ``defs.yaml`` (``defs.pipeline``).
"""

from __future__ import annotations

import os

import dagster as dg

from batch_inference.defs.jobs import PipelineJobs, build_jobs
from batch_inference.defs.keys import DEFAULT, PipelineKeys
from batch_inference.defs.runs.assets import build_run_assets
from batch_inference.defs.runs.checks import build_run_checks
from batch_inference.defs.runs.schedules import build_pipeline_schedule
from batch_inference.defs.runs.start import SpecSource


def default_spec_path(env: os._Environ[str] | dict[str, str] = os.environ, schedule_spec: str | None = None) -> str:
    return schedule_spec or env.get("BATCH_INFERENCE_SCHEDULE_SPEC") or os.path.abspath(".demo/spec.yaml")


def build_definitions(
    *, schedule_spec: str | None = None, schedule_cron: str | None = None, schedule_input: str | None = None,
    env: os._Environ[str] | dict[str, str] = os.environ,
    k: PipelineKeys = DEFAULT, jobs: PipelineJobs | None = None, spec_source: SpecSource | None = None,
    start_job: dg.JobDefinition | None = None, schedule: dg.ScheduleDefinition | None = None,
    deps: tuple[dg.AssetKey, ...] = (), automation_condition: dg.AutomationCondition | None = None,
    approval_floor: float = 0.0, results_io_manager_key: str | None = None,
) -> dg.Definitions:
    """Assets, checks, jobs and the schedule of a pipeline's runs (the project's own, from the environment, by default)."""
    from batch_inference.defs.runs.jobs import build_start_job, start_pipeline_run

    jobs = jobs or build_jobs(k)
    if spec_source is None:  # the project's own pipeline: its spec file from the environment
        spec_path = default_spec_path(env, schedule_spec)
        spec_source = SpecSource(path=spec_path)
        schedule = schedule or build_pipeline_schedule(
            spec_path,
            cron_schedule=schedule_cron or env.get("BATCH_INFERENCE_SCHEDULE_CRON", "0 2 * * *"),
            input_template=schedule_input or env.get("BATCH_INFERENCE_SCHEDULE_INPUT") or None,
        )
    start_job = start_job or (start_pipeline_run if k == DEFAULT else build_start_job(k, spec_source))
    return dg.Definitions(
        assets=build_run_assets(k, spec_source, deps=list(deps), automation_condition=automation_condition,
                                results_io_manager_key=results_io_manager_key),
        asset_checks=[build_run_checks(k, approval_floor)],
        jobs=[start_job, jobs.shard, jobs.tail, jobs.results],
        schedules=[schedule] if schedule is not None else [],
    )
