"""Strategy 1 rounds as assets: pending -> inferred -> approved / rejected / failed.

Partitioned by ``pipeline x round`` (keys ``"<run>|rNN"``). Round N's ``pending`` is
round N-1's ``rejected`` repacked; the asset graph cannot say so (it would be a cycle),
so the provenance is metadata (``from``) and the round sensor moves a run from one round
to the next. The judge step also asks the pipeline what follows the round
(``PipelineRun.decide``) and records the decision on ``rejected``: the sensor acts on it.
"""

from typing import Any

import dagster as dg

from batch_inference.defs.keys import CPU_OP_TAGS, DEFAULT, GPU_OP_TAGS, GPU_POOL, PipelineKeys
from batch_inference.defs.metadata import funnel_markdown, location, phase_metadata, shard_list, with_row_count
from batch_inference.defs.partitions import parse_round_key, round_label
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.recovery import record_worker
from batch_inference.defs.review.metadata import progress_metadata
from batch_inference.defs.specs import load_spec
from batch_inference.defs.steps import progress_reporter, run_cpu_step, run_gpu_step
from batch_inference.defs.storage.resources import StorageResource
from batch_inference.pipeline.layout import RunLayout

REVIEW_DECISION = "review"  # rejected's decision while the round's review queue is open


def build_round_assets(k: PipelineKeys) -> list:
    """pending -> inferred -> approved/rejected/failed of pipeline ``k``."""

    @dg.asset(
        key=k.pending,
        partitions_def=k.rounds,
        deps=[k.sharded],
        group_name=k.group,
        op_tags=CPU_OP_TAGS,
        kinds={"jsonl"},
        description="A round's input: the sharded input for r00, round N-1's rejected records repacked into full shards after.",
    )
    def pending(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
        key = parse_round_key(context.partition_key)
        record_worker(context)  # lets the round sensor tell a dead run from a live one
        spec = load_spec(context.instance, key.run, storage, k.source)
        outcome = run_cpu_step(spec, lambda run: run.pending_round(key.round))
        summary = outcome.summary
        meta: dict[str, Any] = {"round": dg.MetadataValue.int(key.round),
                                "uri": location(RunLayout(spec.output, spec.run).pending(key.round))}
        if key.round == 0:  # the sharded input itself: nothing written
            meta.update({"from": dg.MetadataValue.text(f"sharded[{key.run}]"),
                         "records": dg.MetadataValue.int(summary.records if summary is not None else 0),
                         "shards": dg.MetadataValue.int(len(outcome.shards))})
        else:
            meta.update({
                "from": dg.MetadataValue.text(f"rejected[{key.run}|{round_label(key.round - 1)}]"),
                "records": dg.MetadataValue.int(summary.records),
                "shards": dg.MetadataValue.int(summary.shards_out),
                "shards_in": dg.MetadataValue.int(summary.shards_in),
                "wall_s": dg.MetadataValue.float(round(summary.wall_s, 3)),
                "resumed": dg.MetadataValue.bool(summary.resumed),
            })
        meta["shard_urls"] = shard_list(outcome.shards)
        return dg.MaterializeResult(metadata=with_row_count(meta))


    @dg.asset(
        key=k.inferred,
        partitions_def=k.rounds,
        deps=[k.pending],
        group_name=k.group,
        op_tags=GPU_OP_TAGS,
        pool=GPU_POOL,
        kinds={"jsonl"},
        description="One inference per pending record, through the persistent pool; failed shard tasks are quarantined.",
    )
    def inferred(context: dg.AssetExecutionContext, pool: PoolResource, judge_pool: PoolResource,
                 storage: StorageResource) -> dg.MaterializeResult:
        key = parse_round_key(context.partition_key)
        record_worker(context)  # lets the round sensor tell a dead run from a live one
        spec = load_spec(context.instance, key.run, storage, k.source)
        outcome = run_gpu_step(spec, pool, lambda run: run.inferred_round(key.round), judge_pool, report=progress_reporter(context))
        meta = {k: v for k, v in phase_metadata(outcome.summary).items() if k not in ("approved", "rejected", "approval_rate")}
        meta["shard_urls"] = shard_list(outcome.shards)
        meta.update(pool.describe(spec))
        return dg.MaterializeResult(metadata=with_row_count(meta))


    @dg.multi_asset(
        name=k.name("judge"),
        specs=[
            dg.AssetSpec(k.approved, deps=[k.inferred], group_name=k.group, kinds={"jsonl"},
                         description="A round's approved records, written by the judge straight into results/round-NN-part-*."),
            dg.AssetSpec(k.rejected, deps=[k.inferred], group_name=k.group, kinds={"jsonl"},
                         description="A round's rejected records: the next round's input, or the tail's. Carries the round's decision."),
            dg.AssetSpec(k.failed, deps=[k.pending, k.inferred], group_name=k.group, kinds={"jsonl"},
                         description="Quarantine: shards whose infer or judge task exhausted its retries, with the reason."),
        ],
        partitions_def=k.rounds,
        op_tags=GPU_OP_TAGS,
        pool=GPU_POOL,
    )
    def judge(context: dg.AssetExecutionContext, pool: PoolResource, judge_pool: PoolResource, storage: StorageResource):
        """One step: the round judged, what follows it decided (``PipelineRun.judged_round``)."""
        key = parse_round_key(context.partition_key)
        record_worker(context)  # lets the round sensor tell a dead run from a live one
        spec = load_spec(context.instance, key.run, storage, k.source)
        judged = run_gpu_step(spec, pool, lambda run: run.judged_round(key.round), judge_pool, report=progress_reporter(context))
        rnd = judged.round
        review_meta: dict[str, Any] = {}
        if judged.review is not None:  # people decide the rest: the round sensor waits on the queue
            kind, reason, decision_figures = REVIEW_DECISION, judged.review.text, {}
            review_meta = progress_metadata(judged.review.as_dict(), url=spec.review.url, run=spec.run)
        else:
            kind, reason, decision_figures = judged.decision.kind, judged.decision.reason, judged.decision.figures
        layout = RunLayout(spec.output, spec.run)
        figures = phase_metadata(rnd)
        yield dg.MaterializeResult(asset_key=k.approved, metadata=with_row_count({
            **figures,
            "records": dg.MetadataValue.int(rnd.approved),
            "uri": location(layout.results),
            "shard_prefix": dg.MetadataValue.text(layout.approved_prefix(key.round)),
            "shard_urls": shard_list(judged.approved_shards),
        }))
        yield dg.MaterializeResult(asset_key=k.rejected, metadata=with_row_count({
            **figures,
            "records": dg.MetadataValue.int(rnd.rejected),
            "uri": location(layout.rejected(key.round)),
            "decision": dg.MetadataValue.text(kind),
            "decision_reason": dg.MetadataValue.text(reason),
            "decision_figures": dg.MetadataValue.json(decision_figures),
            # the run's ETA from this round's throughput, next to what the start job planned
            **{k: dg.MetadataValue.float(float(decision_figures[k])) for k in ("eta_run_s", "planned_run_wall_s")
               if decision_figures.get(k) is not None},
            "strategy": dg.MetadataValue.text(spec.strategy),
            "funnel": dg.MetadataValue.md(funnel_markdown(judged.view)),
            **review_meta,
            **pool.describe(spec),
            **judge_pool.describe(spec),
        }))
        quarantined = [q.as_dict() for q in rnd.quarantined]
        yield dg.MaterializeResult(asset_key=k.failed, metadata=with_row_count({
            "round": dg.MetadataValue.int(key.round),
            "records": dg.MetadataValue.int(rnd.records_quarantined),
            "shards": dg.MetadataValue.int(len(quarantined)),
            "uri": location(layout.failed(key.round)),
            "entries": dg.MetadataValue.json(quarantined[:50]),  # the full list is in the ledger
        }))

    return [pending, inferred, judge]


pending, inferred, judge = build_round_assets(DEFAULT)
