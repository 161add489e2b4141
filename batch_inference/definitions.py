"""The Dagster code location: ``dagster dev`` (workspace.yaml) and the demo load ``defs``.

The project's own pipeline (the demo's) is one instance of the per-pipeline factory
(``defs.pipeline``: no prefix, so its names are ``results``, ``round_sensor``, ...); each
domain under ``defs/`` builds its part (runs, rounds, review) and the pool and storage
domains the shared resources. The resources and the nightly schedule are configured from
the environment, so one image serves every deployment (each domain's ``definitions.py``
names its variables; docs/dagster.md tables the resources').
"""

from __future__ import annotations

import dagster as dg

from batch_inference.defs.keys import DEFAULT
from batch_inference.defs.pool import definitions as pool_defs
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.results_io import RESULTS_IO_MANAGER_KEY, ResultsIOManager
from batch_inference.defs.review import definitions as review_defs
from batch_inference.defs.rounds import definitions as rounds_defs
from batch_inference.defs.runs import definitions as runs_defs
from batch_inference.defs.storage import definitions as storage_defs
from batch_inference.defs.storage.definitions import storage_from_env
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
    storage = storage or storage_from_env()
    return dg.Definitions.merge(
        runs_defs.build_definitions(k=DEFAULT, schedule_spec=schedule_spec, schedule_cron=schedule_cron, schedule_input=schedule_input,
                                    results_io_manager_key=RESULTS_IO_MANAGER_KEY),
        rounds_defs.build_definitions(DEFAULT),
        review_defs.build_definitions(DEFAULT),
        pool_defs.build_definitions(pool, judge_pool),
        storage_defs.build_definitions(storage),
        dg.Definitions(resources={RESULTS_IO_MANAGER_KEY: ResultsIOManager(storage=storage)}),
    )


defs = build_definitions()
