"""A cron schedule that starts a pipeline run over a configured input; the sensor does the rest.

Each tick names the run from its template (``nightly-{date}`` -> ``nightly-20261129``;
``{date}`` is the scheduled day, ``{datetime}`` its minute), fills the input URL template
the same way (``s3://drops/{date}/prompts.jsonl``) and launches the pipeline's
``start_pipeline_run``; the run key is the run name, so a re-evaluated tick never starts
a run twice. A missing local spec file skips the tick with a reason instead of failing.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import dagster as dg

from batch_inference.defs.keys import DEFAULT, PipelineKeys
from batch_inference.defs.runs.jobs import start_pipeline_run, start_run_config
from batch_inference.defs.runs.start import SpecSource


def fill(template: str, when: datetime) -> str:
    """``{date}`` -> ``20261129``, ``{datetime}`` -> ``20261129T0200``."""
    return template.format(date=when.strftime("%Y%m%d"), datetime=when.strftime("%Y%m%dT%H%M"))


def build_pipeline_schedule(
    spec_path: str | None,
    *,
    name: str = "nightly_pipeline",
    cron_schedule: str = "0 2 * * *",
    run_prefix: str = "nightly",
    run_name: str | None = None,
    input_template: str | None = None,
    default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.STOPPED,
    job: dg.JobDefinition | None = None,
    spec_source: SpecSource | None = None,
    keys: PipelineKeys = DEFAULT,
) -> dg.ScheduleDefinition:
    """A schedule starting ``run_name`` (a template; default ``<run_prefix>-{date}``) on ``cron_schedule`` (UTC),
    from ``spec_path``, or from the job's own spec (``spec_source``) when that is None."""
    template = run_name or f"{run_prefix}-{{date}}"
    try:  # a bad template fails at load, not at 2 am
        fill(template, datetime(2026, 1, 1))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"run name template {template!r}: use {{date}} and {{datetime}} only ({exc})") from None
    what = spec_path or (spec_source.describe() if spec_source else "its job's spec")

    @dg.schedule(
        name=name,
        job=job or start_pipeline_run,
        cron_schedule=cron_schedule,
        execution_timezone="UTC",
        default_status=default_status,
        description=f"Start run {template} from {what} on '{cron_schedule}' (UTC); the round sensor drives it.",
    )
    def _schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        if spec_path is not None and "://" not in spec_path and not Path(spec_path).is_file():
            return dg.SkipReason(f"spec {spec_path} does not exist (yet): nothing to start")
        if spec_path is None and spec_source is not None and not spec_source.exists():
            return dg.SkipReason(f"{spec_source.describe()} does not exist (yet): nothing to start")
        when = context.scheduled_execution_time
        run = fill(template, when)
        drop = fill(input_template, when) if input_template else None
        return dg.RunRequest(
            run_key=run,
            run_config=start_run_config(spec_path, run=run, input=drop, k=keys),
            tags={"batch_inference/run": run, "batch_inference/scheduled": when.strftime("%Y%m%d")},
        )

    return _schedule


def build_schedule_for(k: PipelineKeys, job: dg.JobDefinition, spec_source: SpecSource, *, cron: str, run_name: str,
                       input_template: str | None = None,
                       default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.STOPPED) -> dg.ScheduleDefinition:
    """A component pipeline's own schedule (``<prefix>__schedule``) over its own spec."""
    return build_pipeline_schedule(None, name=k.name("schedule") if k != DEFAULT else "nightly_pipeline", cron_schedule=cron,
                                   run_name=run_name, input_template=input_template, default_status=default_status, job=job,
                                   spec_source=spec_source, keys=k)
