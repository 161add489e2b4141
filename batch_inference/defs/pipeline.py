"""One pipeline's Dagster definitions, built from a spec and a ``PipelineKeys``.

Every asset, check, job, sensor and schedule of a pipeline is named under its prefix
(``scoring/results``, ``scoring__round_sensor``); its runs are the partitions of its own
``scoring__pipeline_runs``. The project's own pipeline (the demo's) is the one with no
prefix (``batch_inference.definitions``); each ``BatchInferenceComponent`` in a user's
project is another (``batch_inference.components``). The pool and storage resources are
shared by every pipeline of a code location: ``shared_resources`` returns the same
objects each time, as ``Definitions.merge`` accepts one definition per resource key only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import dagster as dg

from batch_inference.defs.jobs import build_jobs
from batch_inference.defs.keys import PipelineKeys
from batch_inference.defs.results_io import RESULTS_IO_MANAGER_KEY, ResultsIOManager
from batch_inference.defs.review import definitions as review_defs
from batch_inference.defs.rounds import definitions as rounds_defs
from batch_inference.defs.runs import definitions as runs_defs
from batch_inference.defs.runs.jobs import build_start_job
from batch_inference.defs.runs.schedules import build_schedule_for
from batch_inference.defs.runs.start import SpecSource


@dataclass(frozen=True)
class ScheduleSpec:
    """A pipeline's own schedule: its cron (UTC) and the run-name template (``{date}``, ``{datetime}``)."""

    cron: str
    run_name: str = "nightly-{date}"
    input: str | None = None  # input URL template; None: the spec's (or the upstream's)
    running: bool = False  # default status: STOPPED unless asked (turn it on in the UI)


@functools.cache
def shared_resources(pool: Any = None) -> dg.Definitions:
    """The resources every pipeline of this code location uses: one object per key (from the
    environment). ``pool``: the host's own (``defs.steps.HostedPool``, the API's), else the environment's."""
    from batch_inference.defs.pool.definitions import pool_from_env
    from batch_inference.defs.storage.definitions import storage_from_env

    storage = storage_from_env()
    return dg.Definitions(resources={
        "pool": pool if pool is not None else pool_from_env(), "judge_pool": pool_from_env(role="judge"), "storage": storage,
        RESULTS_IO_MANAGER_KEY: ResultsIOManager(storage=storage),
    })


def build_pipeline_definitions(
    k: PipelineKeys,
    spec_source: SpecSource,
    *,
    deps: tuple[dg.AssetKey, ...] = (),
    schedule: ScheduleSpec | None = None,
    automation_condition: dg.AutomationCondition | None = None,
    approval_floor: float = 0.0,
    automation_sensor: bool = True,
) -> dg.Definitions:
    """Every definition of one pipeline, without resources (merge with ``shared_resources()``)."""
    jobs = build_jobs(k)
    start_job = build_start_job(k, spec_source)
    sched = build_schedule_for(
        k, start_job, spec_source, cron=schedule.cron, run_name=schedule.run_name, input_template=schedule.input,
        default_status=dg.DefaultScheduleStatus.RUNNING if schedule.running else dg.DefaultScheduleStatus.STOPPED,
    ) if schedule is not None else None
    sensors: list[dg.SensorDefinition] = []
    if automation_sensor:
        # Dagster's default_automation_condition_sensor starts STOPPED in a fresh instance (its
        # AutomationConditionSensorDefinition default status), so a user's eager() asset downstream
        # of results would never fire until someone turns it on in the UI. This one is RUNNING and
        # evaluates exactly the assets right downstream of this pipeline's results.
        sensors.append(dg.AutomationConditionSensorDefinition(
            k.name("downstream_automation"),
            target=dg.AssetSelection.assets(k.results).downstream(depth=1, include_self=False)
            - dg.AssetSelection.assets(k.openai_export, k.parquet_export),
            default_status=dg.DefaultSensorStatus.RUNNING,
            minimum_interval_seconds=15,
            description=f"Evaluates the automation conditions of the assets that read {k.results.to_user_string()}.",
        ))
    return dg.Definitions.merge(
        runs_defs.build_definitions(k=k, jobs=jobs, spec_source=spec_source, start_job=start_job, schedule=sched, deps=deps,
                                    automation_condition=automation_condition, approval_floor=approval_floor,
                                    results_io_manager_key=RESULTS_IO_MANAGER_KEY),
        rounds_defs.build_definitions(k, jobs, deps=deps, start_job=start_job),
        review_defs.build_definitions(k, jobs),
        dg.Definitions(sensors=sensors),
    )
