"""Whole-run checks on ``results``, from one streaming pass over every id of the run.

``conservation`` (every input id in exactly one terminal state) and ``no_duplicate_ids``
(no id in results more often than in the input) come from the pipeline's own
``check_conservation`` (hashed buckets on local disk: memory bounded at any scale), run
again here over the run's storage rather than trusted from the ledger, over the same
terminal sets ``PipelineRun.finalize`` counts (docs/ARCHITECTURE.md, terminal states).
Both block. Each check is partitioned like ``results`` (one result per run, shown on its partition).
``quarantine_empty`` warns when any shard of the run was quarantined; ``approval_floor`` when
fewer than the pipeline's floor of the input records were approved.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg

from batch_inference.defs.keys import DEFAULT, PipelineKeys
from batch_inference.defs.specs import load_spec
from batch_inference.defs.storage.resources import StorageResource


def build_run_checks(k: PipelineKeys, approval_floor: float = 0.0) -> dg.AssetChecksDefinition:
    """The whole-run checks of pipeline ``k``'s ``results``, per run partition."""

    @dg.multi_asset_check(
        name=k.name("run_checks"),
        specs=[
            dg.AssetCheckSpec("conservation", asset=k.results, blocking=True, partitions_def=k.runs,
                              description="every input id is in exactly one terminal state (approved, exhausted, max_attempts, failed)"),
            dg.AssetCheckSpec("no_duplicate_ids", asset=k.results, blocking=True, partitions_def=k.runs,
                              description="no id appears in results more often than in the input"),
            dg.AssetCheckSpec("run_quarantine_empty", asset=k.results, partitions_def=k.runs,
                              description="no shard of the run was quarantined (WARN)"),
            dg.AssetCheckSpec("approval_floor", asset=k.results, partitions_def=k.runs,
                              description=f"approved / input records >= {approval_floor} (WARN; the pipeline's approval_floor)"),
            dg.AssetCheckSpec("structured_output_valid", asset=k.results, partitions_def=k.runs,
                              description="every approved result of a request with a response_format (the spec's or the "
                                          "record's) is JSON that satisfies it"),
        ],
    )
    def run_checks(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> Iterator[dg.AssetCheckResult]:
        from batch_inference.pipeline import PipelineRun
        from batch_inference.pipeline.ledger import check_conservation

        run = context.op_execution_context.partition_key
        spec = load_spec(context.instance, run, storage, k.source)
        pipeline_run = PipelineRun(spec)
        view = pipeline_run.ledger.view()
        quarantined = view.quarantined
        sources = pipeline_run.terminal_sources()
        input_records = view.shard.records if view.shard else 0
        report = check_conservation(sources, input_records=input_records, storage_options=spec.storage_options)
        terminal = {f"terminal.{k}": dg.MetadataValue.int(v) for k, v in report.terminal.items()}
        examples = dg.MetadataValue.json(report.examples)
        conserved = report.missing == 0 and report.extra == 0 and report.input == input_records
        yield dg.AssetCheckResult(
            check_name="conservation", asset_key=k.results, passed=conserved,
            description=(f"{report.input} input ids, each in exactly one terminal state" if conserved else
                         f"{report.missing} missing, {report.extra} extra (input {report.input} of {input_records})"),
            metadata={"input": dg.MetadataValue.int(report.input), "missing": dg.MetadataValue.int(report.missing),
                      "extra": dg.MetadataValue.int(report.extra), **terminal, "examples": examples},
        )
        yield dg.AssetCheckResult(
            check_name="no_duplicate_ids", asset_key=k.results, passed=report.duplicate_results == 0,
            description=f"{report.duplicate_results} duplicate id(s) in results",
            metadata={"duplicate_results": dg.MetadataValue.int(report.duplicate_results), "examples": examples},
        )
        yield dg.AssetCheckResult(
            check_name="run_quarantine_empty", asset_key=k.results, passed=not quarantined, severity=dg.AssetCheckSeverity.WARN,
            description=f"{len(quarantined)} quarantined shard(s)" if quarantined else "nothing quarantined",
            metadata={"shards": dg.MetadataValue.int(len(quarantined)),
                      "records": dg.MetadataValue.int(sum(q.records for q in quarantined))},
        )
        approved = report.terminal.get("approved", 0)  # recounted from storage, like conservation
        approval = approved / input_records if input_records else 1.0
        yield dg.AssetCheckResult(
            check_name="approval_floor", asset_key=k.results, passed=approval >= approval_floor,
            severity=dg.AssetCheckSeverity.WARN,
            description=f"{approved} of {input_records} approved ({approval:.1%}; floor {approval_floor:.1%})",
            metadata={"approved": dg.MetadataValue.int(approved), "approval_rate": dg.MetadataValue.float(round(approval, 4)),
                      "floor": dg.MetadataValue.float(approval_floor)},
        )

        checked, invalid = structured_output_errors(spec, pipeline_run.layout.results)
        yield dg.AssetCheckResult(
            check_name="structured_output_valid", asset_key=k.results, passed=not invalid,
            description=(f"{len(invalid)} of {checked} structured result(s) invalid" if invalid else
                         f"{checked} structured result(s), all valid" if checked else "no structured output requested"),
            metadata={"checked": dg.MetadataValue.int(checked), "invalid": dg.MetadataValue.int(len(invalid)),
                      "examples": dg.MetadataValue.json(invalid[:20])},
        )

    return run_checks


run_checks = build_run_checks(DEFAULT)


def structured_output_errors(spec: Any, results_url: str, *, keep: int = 1000) -> tuple[int, list[dict[str, str]]]:
    """(results checked, invalid ones as {id, error}) for every result row whose request had a
    response_format: the record's own (``response_format``, or an OpenAI Batch line's
    ``body.response_format``), else the spec's ``infer.response_format``."""
    from batch_inference.engines.structured import format_error
    from batch_inference.prompting.config import ResponseFormatConfig
    from batch_inference.storage import JsonlDir

    default = spec.infer.response_format.to_format() if spec.infer.response_format is not None else None
    checked, invalid = 0, []
    for row in JsonlDir(results_url, storage_options=spec.storage_options).iter_records_sync():
        own = row.get("response_format") or (row.get("body") or {}).get("response_format")
        fmt = ResponseFormatConfig.model_validate(own).to_format() if own else default
        if fmt is None:
            continue
        checked += 1
        error = format_error(str(row.get("result") or ""), fmt)
        if error is not None and len(invalid) < keep:
            invalid.append({"id": str(row.get("id")), "error": error})
    return checked, invalid
