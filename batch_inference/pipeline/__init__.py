"""The pipeline layer: spec, layout, CPU passes, Strategy 1 rounds, Strategy 2 tail,
the hybrid crossover and the run ledger. Runs without Dagster.

Names are imported lazily so ``from batch_inference.pipeline import PipelineSpec`` does
not pull in the pool or an engine.
"""

from __future__ import annotations

from batch_inference._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PipelineSpec": "batch_inference.pipeline.spec",
    "PoolSpec": "batch_inference.pipeline.spec",
    "CrossoverRule": "batch_inference.pipeline.spec",
    "LayoutSpec": "batch_inference.pipeline.spec",
    "SpecError": "batch_inference.pipeline.spec",
    "RunLayout": "batch_inference.pipeline.layout",
    "ShardSummary": "batch_inference.pipeline.summaries",
    "PhaseSummary": "batch_inference.pipeline.summaries",
    "RecompactSummary": "batch_inference.pipeline.summaries",
    "LayoutSummary": "batch_inference.pipeline.summaries",
    "Decision": "batch_inference.pipeline.summaries",
    "RunSummary": "batch_inference.pipeline.summaries",
    "QuarantineEntry": "batch_inference.pipeline.summaries",
    "ConservationReport": "batch_inference.pipeline.summaries",
    "RoundView": "batch_inference.pipeline.summaries",
    "Ledger": "batch_inference.pipeline.ledger",
    "LedgerView": "batch_inference.pipeline.summaries",
    "ConservationError": "batch_inference.pipeline.ledger",
    "choose_crossover": "batch_inference.pipeline.policy",
    "decide_round": "batch_inference.pipeline.policy",
    "shard_input": "batch_inference.pipeline.passes",
    "recompact": "batch_inference.pipeline.passes",
    "layout_by_prefix": "batch_inference.pipeline.placement",
    "open_runner": "batch_inference.pipeline.runner",
    "PipelineRun": "batch_inference.pipeline.run",
    "EtaEstimate": "batch_inference.pipeline.run",
    "Reporter": "batch_inference.pipeline.fanout",
    "run_pipeline": "batch_inference.pipeline.driver",
    "run_step": "batch_inference.pipeline.one_step",
    "StepOrderError": "batch_inference.pipeline.run",
    "RoundGate": "batch_inference.pipeline.gate",
    "ReviewStatus": "batch_inference.pipeline.gate",
    "ReviewPending": "batch_inference.pipeline.gate",
    "preflight": "batch_inference.pipeline.preflight",
    "Plan": "batch_inference.pipeline.preflight",
    "InputError": "batch_inference.pipeline.inputs",
    "export_openai_batch": "batch_inference.pipeline.export",
    "ExportSummary": "batch_inference.pipeline.export",
    "ExportError": "batch_inference.pipeline.export",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
