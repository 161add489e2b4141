"""A pipeline run as a whole: its source drop, the one sharding pass, the tail, results.

Partitioned by run name (``pipeline_runs``), the same dynamic definition that is the
``pipeline`` dimension of the round assets, so lineage from ``sharded[run]`` into every
round of that run and from every round into ``results[run]`` is drawn by Dagster.
"""

from collections.abc import Iterator

import dagster as dg
from pydantic import Field

from batch_inference.defs.keys import (
    APPROVED,
    CPU_OP_TAGS,
    FAILED,
    GPU_OP_TAGS,
    OPENAI_EXPORT,
    PARQUET_EXPORT,
    REJECTED,
    RESULTS,
    SHARDED,
    SOURCE,
    TAIL_RETRY,
)
from batch_inference.defs.metadata import funnel_markdown, location, phase_metadata, shard_list, with_row_count
from batch_inference.defs.partitions import RUNS
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.recovery import record_worker
from batch_inference.defs.specs import load_spec
from batch_inference.defs.steps import run_cpu_step, run_gpu_step
from batch_inference.defs.storage.resources import StorageResource
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.summaries import ShardSummary, rate

GROUP = "batch_inference"

source_dataset = dg.AssetSpec(
    SOURCE,
    partitions_def=RUNS,
    group_name=GROUP,
    kinds={"jsonl"},
    description=(
        "The input drop of a pipeline run (JSONL or JsonlDir, anywhere fsspec reaches). External: "
        "the start_pipeline_run job records it, with the run's spec as metadata."
    ),
)


@dg.asset(
    key=SHARDED,
    partitions_def=RUNS,
    deps=[SOURCE],
    group_name=GROUP,
    op_tags=CPU_OP_TAGS,
    kinds={"jsonl"},
    description="The input resharded once on CPU into full zstd shards; ids assigned where missing, duplicates reported.",
)
def sharded(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    record_worker(context)  # lets the round sensor tell a dead run from a live one
    spec = load_spec(context.instance, context.partition_key, storage)
    outcome = run_cpu_step(spec, lambda run: run.sharded_input())
    summary, shards = outcome.summary, outcome.shards
    wall = summary.wall_s
    return dg.MaterializeResult(metadata=with_row_count({
        "records": dg.MetadataValue.int(summary.records),
        "shards": dg.MetadataValue.int(summary.shards),
        "ids_assigned": dg.MetadataValue.int(summary.ids_assigned),
        "duplicate_ids": dg.MetadataValue.int(summary.duplicate_ids),
        "input_format": dg.MetadataValue.text(summary.input_format),
        "records_per_s": dg.MetadataValue.float(round(summary.records / wall, 1) if wall else 0.0),
        "wall_s": dg.MetadataValue.float(round(wall, 3)),
        "strategy": dg.MetadataValue.text(spec.strategy),
        "input": location(summary.input_url),
        "uri": location(summary.output_url),
        "shard_urls": shard_list(shards),
    }))


class TailConfig(dg.Config):
    """Which pending set the tail takes over (the sensor fills this in)."""

    from_round: int = Field(
        description="round whose pending set goes to in-place retry: 0 = the sharded input "
        "(strategy in_place); N > 0 = round N-1's rejected records, repacked first"
    )


@dg.asset(
    key=TAIL_RETRY,
    partitions_def=RUNS,
    deps=[SHARDED, REJECTED],
    group_name=GROUP,
    op_tags=GPU_OP_TAGS,
    kinds={"jsonl"},
    description="Strategy 2 over the stubborn tail: each worker keeps a record until approved or max_attempts, checkpointing per attempt.",
)
def tail_retry(context: dg.AssetExecutionContext, config: TailConfig, pool: PoolResource, judge_pool: PoolResource,
               storage: StorageResource) -> dg.MaterializeResult:
    record_worker(context)  # lets the round sensor tell a dead run from a live one
    spec = load_spec(context.instance, context.partition_key, storage)
    r = config.from_round
    outcome = run_gpu_step(spec, pool, lambda run: run.tail_from(r), judge_pool)  # one step: repack round r-1, then the tail
    summary = outcome.summary
    meta = phase_metadata(summary)
    meta.update({
        "from_round": dg.MetadataValue.int(r),
        "approved": dg.MetadataValue.int(summary.approved),
        "rejected": dg.MetadataValue.int(summary.records_in - summary.approved),
        "unfinished": location(RunLayout(spec.output, spec.run).tail_unfinished),
        "funnel": dg.MetadataValue.md(funnel_markdown(outcome.view)),
        **pool.describe(spec),
        **judge_pool.describe(spec),
    })
    return dg.MaterializeResult(metadata=with_row_count(meta))


@dg.asset(
    key=RESULTS,
    partitions_def=RUNS,
    deps=[APPROVED, FAILED, TAIL_RETRY],
    group_name=GROUP,
    kinds={"jsonl"},
    op_tags=CPU_OP_TAGS,
    description="Every approved record of the run, once; the ledger proves every input id reached one terminal state.",
)
def results(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    record_worker(context)  # lets the round sensor tell a dead run from a live one
    spec = load_spec(context.instance, context.partition_key, storage)
    outcome = run_cpu_step(spec, lambda run: run.finish())
    summary = outcome.summary
    layout = RunLayout(spec.output, spec.run)
    records, wall = summary.records, summary.wall_s
    return dg.MaterializeResult(metadata=with_row_count({
        "status": dg.MetadataValue.text(summary.status),
        "records": dg.MetadataValue.int(records),
        "approved": dg.MetadataValue.int(summary.approved),
        "rejected": dg.MetadataValue.int(summary.unfinished),
        "exhausted": dg.MetadataValue.int(summary.exhausted),
        "max_attempts": dg.MetadataValue.int(summary.max_attempts),
        "failed": dg.MetadataValue.int(summary.failed),
        "quarantined": dg.MetadataValue.int(summary.quarantined),
        "approval_rate": dg.MetadataValue.float(rate(summary.approved, records)),
        "rounds": dg.MetadataValue.int(summary.rounds),
        "tail": dg.MetadataValue.bool(summary.tail),
        "tokens_in": dg.MetadataValue.int(summary.tokens_in),
        "tokens_out": dg.MetadataValue.int(summary.tokens_out),
        "utilization": dg.MetadataValue.float(rate(summary.engine_busy_s, wall)),
        "records_per_s": dg.MetadataValue.float(round(records / wall, 2) if wall else 0.0),
        "wall_s": dg.MetadataValue.float(round(wall, 3)),
        "conservation_ok": dg.MetadataValue.bool(summary.conservation.ok),
        "uri": location(layout.results),
        "ledger": location(layout.ledger),
        "shard_urls": shard_list(outcome.shards),
        "funnel": dg.MetadataValue.md(funnel_markdown(outcome.view)),
    }, rows=summary.approved))


@dg.asset(
    key=OPENAI_EXPORT,
    partitions_def=RUNS,
    deps=[RESULTS],
    group_name=GROUP,
    kinds={"jsonl"},
    op_tags=CPU_OP_TAGS,
    output_required=False,
    description=(
        "The run in the OpenAI Batch output format: output.jsonl (answers, with usage) and errors.jsonl "
        "(every other request, with its reason); every request in exactly one. Written for runs whose "
        "input was an OpenAI Batch file, or whose spec names it in `export` (`batch-inference export` writes it for any run)."
    ),
)
def openai_batch_export(context: dg.AssetExecutionContext, storage: StorageResource) -> Iterator[dg.MaterializeResult]:
    from batch_inference.pipeline import PipelineRun, export_openai_batch

    record_worker(context)
    spec = load_spec(context.instance, context.partition_key, storage)
    run = PipelineRun(spec)
    shard = run.ledger.read_as(RunLayout.SHARD, ShardSummary)
    if (shard is None or shard.input_format != "openai_batch") and "openai_batch" not in spec.export:
        context.log.info("run %s: native JSONL input; no OpenAI Batch export (run `batch-inference export` for one)", spec.run)
        return
    summary = export_openai_batch(run)
    yield dg.MaterializeResult(metadata=with_row_count({
        "output": location(summary.output_url),
        "errors": location(summary.errors_url),
        "requests": dg.MetadataValue.int(summary.requests),
        "answered": dg.MetadataValue.int(summary.output),
        "failed_requests": dg.MetadataValue.int(summary.errors),
        "errors_by_code": dg.MetadataValue.json(summary.errors_by_code),
        "prompt_tokens": dg.MetadataValue.int(summary.prompt_tokens),
        "completion_tokens": dg.MetadataValue.int(summary.completion_tokens),
        "wall_s": dg.MetadataValue.float(round(summary.wall_s, 3)),
    }, rows=summary.requests))


@dg.asset(
    key=PARQUET_EXPORT,
    partitions_def=RUNS,
    deps=[RESULTS],
    group_name=GROUP,
    kinds={"parquet"},
    op_tags=CPU_OP_TAGS,
    output_required=False,
    description=(
        "The run as Parquet: every input record once, its input columns in their own Arrow types, plus "
        "status, result, error and attempts. Written for runs whose spec says `export: [parquet]` "
        "(`batch-inference export --format parquet` writes it for any run)."
    ),
)
def parquet_export(context: dg.AssetExecutionContext, storage: StorageResource) -> Iterator[dg.MaterializeResult]:
    from batch_inference.pipeline import PipelineRun
    from batch_inference.pipeline.parquet_export import export_parquet

    record_worker(context)
    spec = load_spec(context.instance, context.partition_key, storage)
    if "parquet" not in spec.export:
        context.log.info("run %s: the spec asks for no Parquet export (export: [parquet]; or `batch-inference export`)", spec.run)
        return
    summary = export_parquet(PipelineRun(spec))
    yield dg.MaterializeResult(metadata=with_row_count({
        "uri": location(summary.out_url),
        "files": dg.MetadataValue.int(len(summary.files)),
        "by_status": dg.MetadataValue.json(summary.by_status),
        "columns": dg.MetadataValue.json(summary.columns),
        "wall_s": dg.MetadataValue.float(round(summary.wall_s, 3)),
    }, rows=summary.records))
