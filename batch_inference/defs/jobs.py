"""The jobs the round sensor launches: one per kind of step it can request.

Each is an asset job over one partitions definition (a Dagster run targets one
partition): ``shard`` and ``tail``/``results`` per pipeline run, ``round`` per
``<run>|rNN``. Running a round as one job keeps its blocking checks inside the run, so a
round whose conservation check fails ends in a failed run, which the sensor never
advances from.

Every job carries ``dagster/max_retries: 0``: the round sensor retries a step whose run
worker died (``defs.recovery``); Dagster's run retries, if an instance turns them on for
other jobs, must not start a second run of the same step next to the sensor's.
"""

from __future__ import annotations

import dagster as dg

from batch_inference.defs.keys import (
    APPROVED,
    FAILED,
    GPU_RUN_TAGS,
    INFERRED,
    OPENAI_EXPORT,
    PARQUET_EXPORT,
    PENDING,
    REJECTED,
    RESULTS,
    REVIEWED,
    SHARDED,
    TAIL_RETRY,
)

NO_DAGSTER_RETRIES = {"dagster/max_retries": "0"}

shard_job = dg.define_asset_job(
    "shard_job", selection=dg.AssetSelection.assets(SHARDED), tags=NO_DAGSTER_RETRIES, description="Reshard a run's input (CPU, once)."
)
round_job = dg.define_asset_job(
    "round_job",
    selection=dg.AssetSelection.assets(PENDING, INFERRED, APPROVED, REJECTED, FAILED),
    tags={**GPU_RUN_TAGS, **NO_DAGSTER_RETRIES},
    description="One Strategy 1 round of one run: pending -> inferred -> approved/rejected/failed, with its checks.",
)
tail_job = dg.define_asset_job(
    "tail_job", selection=dg.AssetSelection.assets(TAIL_RETRY), tags={**GPU_RUN_TAGS, **NO_DAGSTER_RETRIES},
    description="Strategy 2 in-place retry over a run's remaining records.",
)
results_job = dg.define_asset_job(
    "results_job", selection=dg.AssetSelection.assets(RESULTS, OPENAI_EXPORT, PARQUET_EXPORT), tags=NO_DAGSTER_RETRIES,
    description="Finalize a run: terminal sets, the conservation proof, the ledger (and the exports: OpenAI Batch for an OpenAI Batch input, and those the spec names in `export`).",
)

review_job = dg.define_asset_job(
    "review_job", selection=dg.AssetSelection.assets(REVIEWED), tags=NO_DAGSTER_RETRIES,
    description="Close a round's human review (its queue is empty or its timeout policy applies) and decide what follows.",
)

ASSET_JOBS = [shard_job, round_job, tail_job, results_job, review_job]
