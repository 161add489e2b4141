"""The review step: a round whose judge sent records to people waits at its gate
(``pipeline.gate.RoundGate``, wired in by whoever builds the run) until they are decided."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from batch_inference.pipeline.fanout import Reporter
from batch_inference.pipeline.gate import ReviewPending, ReviewStatus, RoundGate, ledger_resolved
from batch_inference.pipeline.steps.context import RunContext
from batch_inference.pipeline.summaries import PhaseSummary, ReviewSummary
from batch_inference.pool.protocol import REVIEW_OUTPUT
from batch_inference.storage import JsonlFile

log = logging.getLogger(__name__)


def needs_review(ctx: RunContext, r: int) -> bool:
    """Whether judge(r) sent records to people (sync, cheap: the ledger)."""
    judge = ctx.ledger.read_as(ctx.layout.step_name(r, "judge"), PhaseSummary)
    return bool(judge and judge.counts.get(REVIEW_OUTPUT, 0))


def review_resolved(ctx: RunContext, r: int) -> bool:
    """Whether round ``r``'s review was closed (its outcome recorded; blocking)."""
    return ctx.ledger.read(ledger_resolved(r)) is not None


class ReviewStep:
    """Round ``r``'s review through the run's gate: whether it waits, where it stands, its close."""

    def __init__(self, ctx: RunContext, gate: Callable[[], RoundGate]) -> None:
        self.ctx = ctx
        self.gate = gate

    def needed(self, r: int) -> bool:
        return needs_review(self.ctx, r)

    def resolved(self, r: int) -> bool:
        return review_resolved(self.ctx, r)

    def status(self, r: int, *, now: float | None = None) -> ReviewStatus:
        ctx = self.ctx
        return self.gate().status(ctx.spec, ctx.layout, ctx.ledger, r, now=now)

    def resolve(self, r: int, *, now: float | None = None) -> ReviewSummary:
        ctx = self.ctx
        return self.gate().resolve(ctx.spec, ctx.layout, ctx.ledger, r, now=now)

    async def wait(self, r: int, reporter: Reporter) -> ReviewSummary:
        """Poll (``review.poll_s``) until round ``r``'s review can close, then close it; each look
        goes to ``reporter.review_waiting(r, text, url)`` when it has one."""
        spec = self.ctx.spec
        said = None
        while True:
            st = await asyncio.to_thread(self.status, r)
            if st.resolved or st.resolvable:
                try:
                    return await asyncio.to_thread(self.resolve, r)
                except ReviewPending as exc:
                    log.info("run %s round %d: %s", spec.run, r, exc)
                    await asyncio.sleep(spec.review.poll_s)
                    continue
            if st.text != said:
                log.info("run %s round %d: %s (review page: `batch-inference review`)", spec.run, r, st.text)
                said = st.text
            if (waiting := getattr(reporter, "review_waiting", None)) is not None:
                waiting(r, st.text, spec.review.url)
            await asyncio.sleep(spec.review.poll_s)

    def round_counts(self, r: int) -> dict[str, int]:
        """Every count of round ``r``, streamed from its shards (blocking); quarantine from the ledger.

        ``awaiting`` is the review queue while the review is open; once it is resolved the
        reviewed rows count in ``approved`` / ``rejected`` instead, so
        inferred = approved + rejected + awaiting + judge_quarantined at every moment.
        """
        ctx, layout = self.ctx, self.ctx.layout

        def files(url: str) -> list[JsonlFile]:
            d = ctx.dir(url)
            return d.shards() if d.exists_sync() else []

        def count(fs: list[JsonlFile]) -> int:
            return sum(sum(1 for _ in f.iter_records_sync()) for f in fs)

        resolved = self.resolved(r)
        prefix, reviewed = layout.approved_prefix(r), layout.reviewed_prefix(r)
        infer = ctx.ledger.read_as(layout.step_name(r, "infer"), PhaseSummary)
        judge = ctx.ledger.read_as(layout.step_name(r, "judge"), PhaseSummary)
        return {
            "pending": count(files(layout.pending(r))),
            "inferred": count(files(layout.inferred(r))),
            "approved": count([f for f in files(layout.results)
                               if f.name.startswith(prefix) and (resolved or not f.name.startswith(reviewed))]),
            "rejected": count([f for f in files(layout.rejected(r))
                               if resolved or not f.name.startswith(layout.REVIEWED_REJECTED_PREFIX)]),
            "awaiting": 0 if resolved else count(files(layout.review_queue(r))),
            "infer_quarantined": infer.records_quarantined if infer else 0,
            "judge_quarantined": judge.records_quarantined if judge else 0,
        }
