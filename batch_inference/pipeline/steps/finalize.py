"""The run's end: exhausted rows written, conservation checked over every terminal state, the
run recorded, the result cache trimmed; and what each Dagster step shows (``StepOutcome``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from batch_inference.pipeline import passes
from batch_inference.pipeline.gate import AWAITING_REVIEW, ReviewStatus
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import ConservationError, IdSource, check_conservation
from batch_inference.pipeline.steps.context import RunContext, StepOrderError
from batch_inference.pipeline.steps.review import needs_review, review_resolved
from batch_inference.pipeline.summaries import (
    Decision,
    JudgedRound,
    PhaseSummary,
    QuarantineEntry,
    RunSummary,
    ShardSummary,
    StepOutcome,
)
from batch_inference.pool.result_cache import ResultCache

log = logging.getLogger(__name__)


def recorded(ctx: RunContext) -> tuple[int, list[PhaseSummary], list[Decision], PhaseSummary | None]:
    """What the ledger holds: rounds inferred, their phases (+ the tail's), decisions, the tail."""
    layout = ctx.layout
    phases: list[PhaseSummary] = []
    decisions: list[Decision] = []
    r = 0
    while (infer := ctx.phase_done(layout.step_name(r, "infer"))) is not None:
        phases.append(infer)
        if (judge := ctx.phase_done(layout.step_name(r, "judge"))) is not None:
            phases.append(judge)
        if (d := ctx.ledger.read_as(layout.step_name(r, "decision"), Decision)) is not None:
            decisions.append(d)
        r += 1
    tail = ctx.phase_done(RunLayout.TAIL)
    if tail:
        phases.append(tail)
    return r, phases, decisions, tail


def quarantined(ctx: RunContext) -> list[QuarantineEntry]:
    """Every quarantined shard entry of the run."""
    return [q for p in recorded(ctx)[1] for q in p.quarantined]


def terminal_sources(ctx: RunContext) -> list[IdSource]:
    """The id sets conservation is checked over: the input and every terminal state (blocking)."""
    layout = ctx.layout
    r, phases, _, _ = recorded(ctx)
    sources = [
        IdSource("input", (layout.sharded,)),
        IdSource("approved", (layout.results,)),
        IdSource("exhausted", (layout.exhausted,)),
        IdSource("unfinished", (layout.tail_unfinished,), status_field=True),
        IdSource("failed", tuple(layout.failed_records(i) for i in range(r))),
    ]
    awaiting = tuple(layout.review_queue(i) for i in range(r) if needs_review(ctx, i) and not review_resolved(ctx, i))
    if awaiting:  # a terminal-state-to-be: conservation holds while people review
        sources.append(IdSource(AWAITING_REVIEW, awaiting))
    held = [q for p in phases for q in p.quarantined]
    if held:
        sources.append(IdSource("failed", tuple(q.shard for q in held), is_dir=False))
    return sources


def trim_result_cache(ctx: RunContext) -> dict[str, Any]:
    """Bound the cross-run result cache (``cache.max_bytes``, oldest entries first); what it
    holds after. A failed trim costs the bound for now, never the run (the next run trims)."""
    spec = ctx.spec
    url = spec.result_cache_url
    if url is None:
        return {}
    try:
        report = ResultCache(url, ctx.storage_options).trim(spec.cache.max_bytes)
    except Exception as exc:
        log.warning("run %s: trimming the result cache %s failed: %s", spec.run, url, exc)
        return {"url": url, "error": str(exc)}
    return {"url": url, "max_bytes": spec.cache.max_bytes, **report.as_dict()}


def finalize(ctx: RunContext) -> RunSummary:
    """Write exhausted rows if the rounds hit their cap, check conservation, record the run (blocking)."""
    spec, layout, so = ctx.spec, ctx.layout, ctx.storage_options
    t0 = time.perf_counter()
    shard = ShardSummary.from_dict(ctx.require(RunLayout.SHARD, "run shard() first"))
    _, phases, decisions, tail = recorded(ctx)
    last = decisions[-1] if decisions else None
    if spec.strategy == "in_place" or (last and last.kind == "tail"):
        if tail is None:
            raise StepOrderError(f"run {spec.run!r}: the tail has not run yet: run tail() first")
    elif last is None or last.kind not in ("done", "exhausted"):
        raise StepOrderError(f"run {spec.run!r}: the rounds have not finished (last decision: {last and last.kind})")
    exhausted = 0
    # the last round's rejected rows: those left at the cap, and any permanent failures of
    # a round that had nothing else left to retry
    if last is not None and not tail and (last.kind == "exhausted" or (last.kind == "done" and last.figures.get("failed"))):
        exhausted = passes.write_exhausted(
            [layout.rejected(last.round)], layout.exhausted, round=last.round, storage_options=so,
            failed_dst=layout.failed_records(last.round), every_error=not spec.judged,
        )
    report = check_conservation(terminal_sources(ctx), input_records=shard.records, storage_options=so)
    t = report.terminal
    held = sum(p.records_quarantined for p in phases)
    status = ("quarantined" if held else "exhausted" if t["exhausted"] or t["max_attempts"]
              else "records_failed" if t["failed"] else "converged")
    summary = RunSummary(
        run=spec.run, url=layout.root, strategy=spec.strategy, status=status,  # type: ignore[arg-type]
        records=shard.records, approved=t["approved"], exhausted=t["exhausted"], max_attempts=t["max_attempts"],
        failed=t["failed"], quarantined=held, rounds=len([p for p in phases if p.phase == "infer"]), tail=tail is not None,
        results_url=layout.results, conservation=report,
        tokens_in=sum(p.tokens_in for p in phases), tokens_out=sum(p.tokens_out for p in phases),
        engine_busy_s=sum(p.engine_busy_s for p in phases),
        wall_s=sum(p.wall_s for p in phases) + shard.wall_s + (time.perf_counter() - t0),
        result_cache_lookups=sum(p.result_cache_lookups for p in phases),
        result_cache_hits=sum(p.result_cache_hits for p in phases),
        engine_requests=sum(p.engine_requests for p in phases),
        result_cache=trim_result_cache(ctx),
    )
    ctx.ledger.write(RunLayout.RUN, summary.as_dict())
    if not report.ok:
        raise ConservationError(
            f"run {spec.run!r}: conservation failed: {report.missing} missing, {report.extra} extra, "
            f"{report.duplicate_results} duplicated in results (input {report.input} of {shard.records}); "
            f"e.g. {report.examples[:5]}"
            + (f"; unreadable (damaged in storage): {report.unreadable}" if report.unreadable else ""), report.as_dict(),
        )
    if exhausted:
        log.warning("run %s: %d record(s) exhausted max_rounds: see %s", spec.run, exhausted, layout.exhausted)
    return summary


# -- what each Dagster step shows (blocking) ----------------------------------------------

def outcome(ctx: RunContext, summary: Any, shards_url: str) -> StepOutcome:
    """A step's summary (None: the shard step's), the ledger, and the shards under ``shards_url``."""
    view = ctx.ledger.view()
    return StepOutcome(summary if summary is not None else view.shard, view, [f.url for f in ctx.dir(shards_url).shards()])


def results_outcome(ctx: RunContext, summary: Any) -> StepOutcome:
    """``summary`` with the ledger and the result shards written so far."""
    results = ctx.dir(ctx.layout.results)
    return StepOutcome(summary, ctx.ledger.view(), [f.url for f in results.shards()] if results.exists_sync() else [])


def judged_round(ctx: RunContext, r: int, status: ReviewStatus | None = None) -> JudgedRound:
    """Round ``r`` as the ledger has it, with the result shards it approved."""
    view = ctx.ledger.view()
    prefix = ctx.layout.approved_prefix(r)
    results = ctx.dir(ctx.layout.results)
    shards = [f.url for f in results.shards() if f.name.startswith(prefix)] if results.exists_sync() else []
    return JudgedRound(round=view.rounds[r], approved_shards=shards, view=view, review=status)
