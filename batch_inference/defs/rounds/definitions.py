"""The rounds domain's definitions: Strategy 1 rounds and the sensor that drives every run."""

from __future__ import annotations

import dagster as dg

from batch_inference.defs.jobs import PipelineJobs, build_jobs
from batch_inference.defs.keys import DEFAULT, PipelineKeys
from batch_inference.defs.rounds.assets import build_round_assets
from batch_inference.defs.rounds.checks import build_round_checks
from batch_inference.defs.rounds.sensors import build_round_sensor


def build_definitions(k: PipelineKeys = DEFAULT, jobs: PipelineJobs | None = None, *, deps: tuple[dg.AssetKey, ...] = (),
                      start_job: dg.JobDefinition | None = None) -> dg.Definitions:
    """A round's assets (pending -> inferred -> approved/rejected/failed), its checks, its job, the round sensor."""
    jobs = jobs or build_jobs(k)
    return dg.Definitions(
        assets=build_round_assets(k),
        asset_checks=build_round_checks(k),
        jobs=[jobs.round],
        sensors=[build_round_sensor(k, jobs, deps=deps, start_job=start_job)],
    )
