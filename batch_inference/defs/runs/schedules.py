"""A cron schedule that starts a pipeline run over a configured input; the sensor does the rest.

Each tick names the run after its scheduled date (``nightly-20261129``), fills the input
URL template with that date (``s3://drops/{date}/prompts.jsonl``) and launches
``start_pipeline_run``; the run key is the run name, so a re-evaluated tick never starts
a night twice. A missing local spec file skips the tick with a reason instead of failing.
"""

from pathlib import Path

import dagster as dg

from batch_inference.defs.runs.jobs import start_pipeline_run, start_run_config


def build_pipeline_schedule(
    spec_path: str,
    *,
    name: str = "nightly_pipeline",
    cron_schedule: str = "0 2 * * *",
    run_prefix: str = "nightly",
    input_template: str | None = None,
    default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.STOPPED,
) -> dg.ScheduleDefinition:
    """A schedule starting ``<run_prefix>-<YYYYMMDD>`` from ``spec_path`` on ``cron_schedule`` (UTC)."""

    @dg.schedule(
        name=name,
        job=start_pipeline_run,
        cron_schedule=cron_schedule,
        execution_timezone="UTC",
        default_status=default_status,
        description=f"Start a pipeline run from {spec_path} on '{cron_schedule}' (UTC); the round sensor drives it.",
    )
    def _schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        if "://" not in spec_path and not Path(spec_path).is_file():
            return dg.SkipReason(f"spec {spec_path} does not exist (yet): nothing to start")
        when = context.scheduled_execution_time
        date = when.strftime("%Y%m%d")
        run = f"{run_prefix}-{date}"
        drop = input_template.format(date=date, datetime=when.strftime("%Y%m%dT%H%M")) if input_template else None
        return dg.RunRequest(
            run_key=run,
            run_config=start_run_config(spec_path, run=run, input=drop),
            tags={"batch_inference/run": run, "batch_inference/scheduled": date},
        )

    return _schedule
