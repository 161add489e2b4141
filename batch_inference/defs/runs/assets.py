"""A pipeline run as a whole: its source drop, the one sharding pass, the tail, results.

Built per pipeline (``build_run_assets``: keys under its prefix). Partitioned by run name
(``PipelineKeys.runs``), the same dynamic definition that is the
``pipeline`` dimension of the round assets, so lineage from ``sharded[run]`` into every
round of that run and from every round into ``results[run]`` is drawn by Dagster.
"""

import os
from collections.abc import Iterator
from typing import Any

import dagster as dg
from pydantic import Field

from batch_inference.defs.keys import CPU_OP_TAGS, DEFAULT, GPU_OP_TAGS, GPU_POOL, PipelineKeys
from batch_inference.defs.metadata import funnel_markdown, location, phase_metadata, result_cache_run_metadata, shard_list, with_row_count
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.recovery import record_worker
from batch_inference.defs.runs.start import SourceConfig, SpecSource, start_source
from batch_inference.defs.specs import load_spec
from batch_inference.defs.steps import progress_reporter, run_cpu_step, run_gpu_step
from batch_inference.defs.storage.resources import StorageResource
from batch_inference.pipeline.accounting import InputAccount
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.summaries import ShardSummary, rate


class TailConfig(dg.Config):
    """Which pending set the tail takes over (the sensor fills this in)."""

    from_round: int = Field(
        description="round whose pending set goes to in-place retry: 0 = the sharded input "
        "(strategy in_place); N > 0 = round N-1's rejected records, repacked first"
    )


def build_run_assets(k: PipelineKeys, spec_source: SpecSource, *, deps: list[dg.AssetKey] | None = None,
                     automation_condition: dg.AutomationCondition | None = None,
                     results_io_manager_key: str | None = None) -> list[Any]:
    """The run-level assets of pipeline ``k``: ``source_dataset`` (materialising a new partition
    starts a run of ``spec_source``), ``sharded``, ``tail_retry``, ``results`` and the two exports."""

    @dg.asset(
        key=k.source,
        partitions_def=k.runs,
        deps=deps or [],
        group_name=k.group,
        op_tags=CPU_OP_TAGS,
        kinds={"jsonl"},
        automation_condition=automation_condition,
        description=(
            f"The input drop of a run of {k.label} ({spec_source.describe()}). Materialise a new partition (its name is the run's) "
            "to start a run: the spec is validated and recorded here as metadata, the round sensor does the rest. The input "
            "is the config's `input`, else the path in the newest materialisation of an upstream asset, else the spec's."
        ),
    )
    def source_dataset(context: dg.AssetExecutionContext, config: SourceConfig, storage: StorageResource) -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata=start_source(context, config, storage, spec_source, k, deps or []))

    @dg.asset(
        key=k.sharded,
        partitions_def=k.runs,
        deps=[k.source],
        group_name=k.group,
        op_tags=CPU_OP_TAGS,
        kinds={"jsonl"},
        description="The input resharded once on CPU into full zstd shards; ids assigned where missing, duplicates reported.",
    )
    def sharded(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
        record_worker(context)  # lets the round sensor tell a dead run from a live one
        spec = load_spec(context.instance, context.partition_key, storage, k.source)
        outcome = run_cpu_step(spec, lambda run: run.sharded_input())
        summary, shards = outcome.summary, outcome.shards
        wall = summary.wall_s
        account = InputAccount.of_shard(summary, summary.quarantine_url or None)  # the CLI's rule: pipeline.accounting
        warnings = {"input_warnings": dg.MetadataValue.md("\n".join(f"- {n}" for n in account.notes()))} if account.notes() else {}
        return dg.MaterializeResult(metadata=with_row_count({
            "input_lines": dg.MetadataValue.int(account.lines),
            "malformed": dg.MetadataValue.int(account.malformed),
            **warnings,
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


    @dg.asset(
        key=k.tail_retry,
        partitions_def=k.runs,
        deps=[k.sharded, k.rejected],
        group_name=k.group,
        op_tags=GPU_OP_TAGS,
        pool=GPU_POOL,
        kinds={"jsonl"},
        description="Strategy 2 over the stubborn tail: each worker keeps a record until approved or max_attempts, checkpointing per attempt.",
    )
    def tail_retry(context: dg.AssetExecutionContext, config: TailConfig, pool: PoolResource, judge_pool: PoolResource,
                   storage: StorageResource) -> dg.MaterializeResult:
        record_worker(context)  # lets the round sensor tell a dead run from a live one
        spec = load_spec(context.instance, context.partition_key, storage, k.source)
        r = config.from_round
        outcome = run_gpu_step(spec, pool, lambda run: run.tail_from(r), judge_pool, report=progress_reporter(context))  # one step: repack round r-1, then the tail
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
        key=k.results,
        partitions_def=k.runs,
        # a downstream asset that takes results as an input loads them through this IO manager
        # (defs.results_io: rows, a path or a pyarrow dataset); the data itself stays in storage
        io_manager_key=results_io_manager_key or "io_manager",
        deps=[k.approved, k.failed, k.tail_retry],
        group_name=k.group,
        kinds={"jsonl"},
        op_tags=CPU_OP_TAGS,
        description="Every approved record of the run, once; the ledger proves every input id reached one terminal state.",
    )
    def results(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
        record_worker(context)  # lets the round sensor tell a dead run from a live one
        spec = load_spec(context.instance, context.partition_key, storage, k.source)
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
            **result_cache_run_metadata(summary),
        }, rows=summary.approved))


    @dg.asset(
        key=k.openai_export,
        partitions_def=k.runs,
        deps=[k.results],
        group_name=k.group,
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
        spec = load_spec(context.instance, context.partition_key, storage, k.source)
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
        key=k.parquet_export,
        partitions_def=k.runs,
        deps=[k.results],
        group_name=k.group,
        kinds={"parquet"},
        op_tags=CPU_OP_TAGS,
        output_required=False,
        description=(
            "The run as Parquet: every input record once, in the input's order, its input columns as they went in, plus "
            "the struct column `run` (status, result, error, attempts, finish_reason, tokens, cached). Written for runs whose spec says `export: [parquet]` "
            "(`batch-inference export --format parquet` writes it for any run)."
        ),
    )
    def parquet_export(context: dg.AssetExecutionContext, storage: StorageResource) -> Iterator[dg.MaterializeResult]:
        from batch_inference.pipeline import PipelineRun
        from batch_inference.pipeline.parquet_export import export_parquet

        record_worker(context)
        spec = load_spec(context.instance, context.partition_key, storage, k.source)
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

    return [source_dataset, sharded, tail_retry, results, openai_batch_export, parquet_export]


# The project's own pipeline's (what batch_inference.definitions builds, for imports and tests).
source_dataset, sharded, tail_retry, results, openai_batch_export, parquet_export = build_run_assets(
    DEFAULT, SpecSource(path=os.environ.get("BATCH_INFERENCE_SCHEDULE_SPEC") or os.path.abspath(".demo/spec.yaml")))
