"""The jobs the round sensor launches: one per kind of step it can request.

Each is an asset job over one partitions definition (a Dagster run targets one
partition): ``shard`` and ``tail``/``results`` per pipeline run, ``round`` per
``<run>|rNN``. Running a round as one job keeps its blocking checks inside the run, so a
round whose conservation check fails ends in a failed run, which the sensor never
advances from. Every pipeline (``PipelineKeys``) has its own set, named under its prefix.

Every job carries ``dagster/max_retries: 0``: the round sensor retries a step whose run
worker died (``defs.recovery``); Dagster's run retries, if an instance turns them on for
other jobs, must not start a second run of the same step next to the sensor's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import dagster as dg

from batch_inference.defs.keys import DEFAULT, GPU_RUN_TAGS, PipelineKeys

NO_DAGSTER_RETRIES = {"dagster/max_retries": "0"}


@dataclass(frozen=True)
class PipelineJobs:
    """One pipeline's step jobs."""

    shard: dg.UnresolvedAssetJobDefinition
    round: dg.UnresolvedAssetJobDefinition
    tail: dg.UnresolvedAssetJobDefinition
    results: dg.UnresolvedAssetJobDefinition
    review: dg.UnresolvedAssetJobDefinition
    tail_op: str = "tail_retry"  # the op of the tail asset, which the tail job's run config names (prefixed under a prefix)

    @property
    def all(self) -> list[dg.UnresolvedAssetJobDefinition]:
        return [self.shard, self.round, self.tail, self.results, self.review]


@functools.cache
def build_jobs(k: PipelineKeys) -> PipelineJobs:
    """The step jobs of the pipeline ``k`` (one set per pipeline: the sensor and the domains share it)."""
    return PipelineJobs(
        shard=dg.define_asset_job(
            k.name("shard_job"), selection=dg.AssetSelection.assets(k.sharded), tags=NO_DAGSTER_RETRIES,
            description="Reshard a run's input (CPU, once)."),
        round=dg.define_asset_job(
            k.name("round_job"),
            selection=dg.AssetSelection.assets(k.pending, k.inferred, k.approved, k.rejected, k.failed),
            tags={**GPU_RUN_TAGS, **NO_DAGSTER_RETRIES},
            description="One Strategy 1 round of one run: pending -> inferred -> approved/rejected/failed, with its checks."),
        tail=dg.define_asset_job(
            k.name("tail_job"), selection=dg.AssetSelection.assets(k.tail_retry), tags={**GPU_RUN_TAGS, **NO_DAGSTER_RETRIES},
            description="Strategy 2 in-place retry over a run's remaining records."),
        results=dg.define_asset_job(
            k.name("results_job"), selection=dg.AssetSelection.assets(k.results, k.openai_export, k.parquet_export),
            tags=NO_DAGSTER_RETRIES,
            description="Finalize a run: terminal sets, the conservation proof, the ledger (and the exports: OpenAI Batch for an OpenAI Batch input, and those the spec names in `export`)."),
        review=dg.define_asset_job(
            k.name("review_job"), selection=dg.AssetSelection.assets(k.reviewed), tags=NO_DAGSTER_RETRIES,
            description="Close a round's human review (its queue is empty or its timeout policy applies) and decide what follows."),
        tail_op=k.tail_retry.to_python_identifier(),
    )


_DEFAULT = build_jobs(DEFAULT)  # the project's own pipeline
shard_job, round_job, tail_job, results_job, review_job = (_DEFAULT.shard, _DEFAULT.round, _DEFAULT.tail, _DEFAULT.results,
                                                           _DEFAULT.review)
ASSET_JOBS = _DEFAULT.all
