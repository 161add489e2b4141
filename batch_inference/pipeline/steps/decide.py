"""What follows a round: the decision (next round, tail, done, exhausted) with the run's ETA,
and recompaction (rejected(r) -> pending(r + 1) in full shards)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Protocol

from batch_inference.pipeline import passes
from batch_inference.pipeline.gate import ReviewPending, ledger_resolved
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.policy import decide_round
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.steps.context import RunContext, StepOrderError
from batch_inference.pipeline.summaries import Decision, PhaseSummary, RecompactSummary
from batch_inference.pool.protocol import REVIEW_OUTPUT

log = logging.getLogger(__name__)


class EtaEstimate(Protocol):
    """Seconds a run still needs after round ``r`` was decided (``planning.eta_after_round``)."""

    def __call__(self, spec: PipelineSpec, r: int, infer: PhaseSummary, judge: PhaseSummary, decision_kind: str,
                 *, recompact_s: float = 0.0) -> float: ...


def decide(ctx: RunContext, r: int, eta: EtaEstimate | None = None) -> Decision:
    """What follows round ``r`` (sync and cheap); recorded once, read back after."""
    spec, layout = ctx.spec, ctx.layout
    name = layout.step_name(r, "decision")
    if (data := ctx.ledger.read(name)) is not None:
        return Decision.from_dict(data)
    if spec.strategy == "in_place":
        raise StepOrderError("strategy 'in_place' has no rounds to decide: run tail(0)")
    infer = PhaseSummary.from_dict(ctx.require(layout.step_name(r, "infer"), f"run infer({r}) first"))
    judge = PhaseSummary.from_dict(ctx.require(layout.step_name(r, "judge"), f"run judge({r}) first"))
    last = ctx.ledger.read(layout.step_name(r, "recompact")) if r > 0 and spec.strategy == "hybrid" else None
    recompact_s = float(last["wall_s"]) if last else 0.0
    reviewed = None
    if judge.counts.get(REVIEW_OUTPUT, 0):
        reviewed = ctx.ledger.read(ledger_resolved(r))
        if reviewed is None:
            raise ReviewPending(f"run {spec.run!r} round {r}: {judge.counts[REVIEW_OUTPUT]} record(s) sent to "
                                f"review; run resolve_review({r}) once the queue is empty")
    decision = decide_round(spec, r, infer, judge, recompact_s=recompact_s, reviewed=reviewed)
    decision = replace(decision, figures={**decision.figures, **_eta(ctx, eta, r, infer, judge, decision.kind, recompact_s)})
    ctx.ledger.write(name, decision.as_dict())
    return decision


def _eta(ctx: RunContext, eta: EtaEstimate | None, r: int, infer: PhaseSummary, judge: PhaseSummary, kind: str,
         recompact_s: float) -> dict[str, Any]:
    """The run's ETA from this round's measured throughput (when the run has an ``eta``), and
    the plan's figure when one was recorded."""
    out: dict[str, Any] = {}
    if eta is not None:
        try:
            out["eta_run_s"] = round(eta(ctx.spec, r, infer, judge, kind, recompact_s=recompact_s), 1)
        except Exception as exc:  # an estimate must never stop a run
            log.warning("run %s: no ETA after round %d: %s", ctx.spec.run, r, exc)
    if (plan := ctx.ledger.read(RunLayout.PLAN)) is not None:
        out["planned_run_wall_s"] = next((s["wall_s"] for s in plan.get("strategies", []) if s["strategy"] == ctx.spec.strategy), None)
    return out


async def recompact(ctx: RunContext, r: int) -> RecompactSummary:
    """rejected(r) -> pending(r + 1) in full shards, cut between prefix families when laid out so."""
    layout = ctx.layout
    name = layout.step_name(r + 1, "recompact")
    if (data := await asyncio.to_thread(ctx.resume.done_with_output, name, layout.pending(r + 1))) is not None:
        return RecompactSummary.from_dict({**data, "resumed": True})
    await asyncio.to_thread(ctx.require, layout.step_name(r, "judge"), f"run judge({r}) first")
    t0 = time.perf_counter()
    families = await asyncio.to_thread(ctx.family_cuts)
    records, shards_in, shards_out, cuts_shared = await asyncio.to_thread(
        passes.recompact, layout.rejected(r), layout.pending(r + 1),
        records_per_shard=ctx.spec.shard_records, storage_options=ctx.storage_options,
        failed_dst=layout.failed_records(r), round=r, families=families,
    )
    summary = RecompactSummary(round=r + 1, input_url=layout.rejected(r), output_url=layout.pending(r + 1),
                               records=records, shards_in=shards_in, shards_out=shards_out, wall_s=time.perf_counter() - t0,
                               families=families is not None, cuts_shared=cuts_shared)
    await asyncio.to_thread(ctx.ledger.write, name, summary.as_dict())
    return summary
