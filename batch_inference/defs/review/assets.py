"""``reviewed``: a round's review closed (queue empty, or its timeout policy applied).

Materialised by ``review_job`` when the round sensor finds the round's queue done. The
body is ``PipelineRun.resolve_review`` then ``decide``; the decision is recorded here as
the judge records it on ``rejected`` for rounds without review, and the sensor follows
it up the same way.
"""


import dagster as dg

from batch_inference.defs.keys import CPU_OP_TAGS, DEFAULT, PipelineKeys
from batch_inference.defs.metadata import funnel_markdown, location, phase_metadata
from batch_inference.defs.partitions import parse_round_key
from batch_inference.defs.recovery import record_worker
from batch_inference.defs.review.metadata import review_page
from batch_inference.defs.specs import load_spec
from batch_inference.defs.steps import run_cpu_step
from batch_inference.defs.storage.resources import StorageResource

ROUND_OUTCOME = ("approved", "rejected", "failed_records", "approval_rate")  # of phase_metadata(RoundView)


def build_review_asset(k: PipelineKeys) -> dg.AssetsDefinition:
    """``reviewed`` of pipeline ``k``."""

    @dg.asset(
        key=k.reviewed,
        partitions_def=k.rounds,
        deps=[k.rejected],
        group_name=k.group,
        op_tags=CPU_OP_TAGS,
        kinds={"jsonl"},
        description="A round's human review, closed: verdicts applied (approved into results, rejected to the next round). Carries the round's decision.",
    )
    def reviewed(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
        from batch_inference.pipeline import PipelineRun
        from batch_inference.planning.progress import eta_after_round

        key = parse_round_key(context.partition_key)
        record_worker(context)
        spec = load_spec(context.instance, key.run, storage, k.source)
        summary = run_cpu_step(spec, lambda run: run.resolve_review(key.round)).as_dict()
        run = PipelineRun(spec, eta=eta_after_round)
        decision = run.decide(key.round).as_dict()
        view = run.ledger.view()
        # the round's funnel with people's verdicts counted (the judge's metadata on approved /
        # rejected was written before they were)
        outcome = {k: v for k, v in phase_metadata(view.rounds[key.round]).items() if k in ROUND_OUTCOME}
        return dg.MaterializeResult(metadata={
            **outcome,
            "funnel": dg.MetadataValue.md(funnel_markdown(view)),
            "round": dg.MetadataValue.int(key.round),
            "records": dg.MetadataValue.int(int(summary["records"])),
            "dagster/row_count": dg.MetadataValue.int(int(summary["records"])),
            "review_approved": dg.MetadataValue.int(int(summary["approved"])),
            "review_rejected": dg.MetadataValue.int(int(summary["rejected"])),
            "review_timed_out": dg.MetadataValue.int(int(summary["timed_out"])),
            "review_conflicts": dg.MetadataValue.int(int(summary["conflicts"])),
            "review_by_reviewer": dg.MetadataValue.json(summary["by_reviewer"]),
            "review_conflict_examples": dg.MetadataValue.json(summary["conflict_examples"][:20]),
            "review_page": review_page(spec.review.url, spec.run, key.round),
            "verdicts": location(run.layout.verdicts(key.round)),
            "decision": dg.MetadataValue.text(decision["kind"]),
            "decision_reason": dg.MetadataValue.text(str(decision.get("reason", ""))),
            "decision_figures": dg.MetadataValue.json(decision.get("figures") or {}),
            "strategy": dg.MetadataValue.text(spec.strategy),
        })

    return reviewed


reviewed = build_review_asset(DEFAULT)
