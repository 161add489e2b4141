"""The Dagster code location: ``dagster dev`` (workspace.yaml) and the demo load ``defs``.

Each domain under ``defs/`` builds its own ``Definitions`` (its assets, checks, jobs,
sensors, schedules, resources) in its ``definitions.py``; this module merges them. The
resources and the nightly schedule are configured from the environment, so one image
serves every deployment (each domain's ``definitions.py`` names its variables; docs/dagster.md
tables the resources').
"""

from __future__ import annotations

import dagster as dg

from batch_inference.defs.pool import definitions as pool_defs
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.review import definitions as review_defs
from batch_inference.defs.rounds import definitions as rounds_defs
from batch_inference.defs.runs import definitions as runs_defs
from batch_inference.defs.storage import definitions as storage_defs
from batch_inference.defs.storage.resources import StorageResource


def build_definitions(
    *,
    pool: PoolResource | None = None,
    judge_pool: PoolResource | None = None,
    storage: StorageResource | None = None,
    schedule_spec: str | None = None,
    schedule_cron: str | None = None,
    schedule_input: str | None = None,
) -> dg.Definitions:
    """Every domain's definitions, with resources and the schedule's spec injectable (tests, demo)."""
    return dg.Definitions.merge(
        runs_defs.build_definitions(schedule_spec=schedule_spec, schedule_cron=schedule_cron, schedule_input=schedule_input),
        rounds_defs.build_definitions(),
        review_defs.build_definitions(),
        pool_defs.build_definitions(pool, judge_pool),
        storage_defs.build_definitions(storage),
    )


defs = build_definitions()
