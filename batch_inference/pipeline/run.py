"""A pipeline run as idempotent, resumable steps (docs/ARCHITECTURE.md "the steps of a run").

``PipelineRun`` is the façade the driver, the Dagster steps and the API call: each method
is one step of ``pipeline.steps`` (shard, rounds, review, decide, tail, finalize) over one
``RunContext`` (spec, layout, ledger). No step holds state between calls beyond what is in
storage, so the Dagster layer can call each from its own process, and a killed driver re-runs
into a resume; the one exception is the shard step started in this process and the feed it
fills for round 0, which ``ShardStep`` owns and round 0 takes once.
``pipeline.driver`` calls the steps in sequence; ``pipeline.one_step`` calls one of them
from outside an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from batch_inference.pipeline.fanout import Reporter
from batch_inference.pipeline.gate import ReviewStatus, RoundGate, default_gate
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import IdSource, Ledger
from batch_inference.pipeline.resume import Resume
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.steps import decide as deciding
from batch_inference.pipeline.steps import finalize as ending
from batch_inference.pipeline.steps import tail as tailing
from batch_inference.pipeline.steps.context import RunContext, StepOrderError
from batch_inference.pipeline.steps.decide import EtaEstimate
from batch_inference.pipeline.steps.review import ReviewStep
from batch_inference.pipeline.steps.rounds import InferStep, JudgeStep
from batch_inference.pipeline.steps.shard import ShardStep
from batch_inference.pipeline.summaries import (
    Decision,
    JudgedRound,
    PhaseSummary,
    QuarantineEntry,
    RecompactSummary,
    ReviewSummary,
    RunSummary,
    ShardSummary,
    StepOutcome,
)
from batch_inference.pool.protocol import TaskRunner

log = logging.getLogger(__name__)

__all__ = ["EtaEstimate", "PipelineRun", "Reporter", "StepOrderError"]


class PipelineRun:
    """The steps of one run. ``runner`` is needed only by ``infer``, ``judge`` and ``tail``.

    ``eta``, when given, adds the run's ETA to each recorded decision (the pipeline does not
    plan: whoever builds the run passes the planner's estimate). ``gate`` is where a round
    whose judge sent records to people waits (``pipeline.gate.RoundGate``; the composition
    roots pass ``review.ReviewGate()``, a run built without one gets the library's default).
    ``stream_round0``: round 0 may start beside the shard step's layout pass (``run_pipeline``).
    """

    def __init__(self, spec: PipelineSpec, runner: TaskRunner | None = None, *, reporter: Reporter | None = None,
                 eta: EtaEstimate | None = None, stream_round0: bool = False, gate: RoundGate | None = None) -> None:
        self.ctx = RunContext(spec, reporter) if reporter is not None else RunContext(spec)
        self.runner = runner
        self.eta = eta
        self.gate = gate
        self._shard = ShardStep(self.ctx, stream_round0=stream_round0)
        self._infer = InferStep(self.ctx, self._shard.take_feed)
        self._judge = JudgeStep(self.ctx, self._round_gate)
        self._review = ReviewStep(self.ctx, self._round_gate)

    def _round_gate(self) -> RoundGate:
        if self.gate is None:
            self.gate = default_gate()
        return self.gate

    @property
    def spec(self) -> PipelineSpec:
        return self.ctx.spec

    @property
    def layout(self) -> RunLayout:
        return self.ctx.layout

    @property
    def ledger(self) -> Ledger:
        return self.ctx.ledger

    @property
    def resume(self) -> Resume:
        return self.ctx.resume

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.ctx.storage_options

    @property
    def reporter(self) -> Reporter:
        return self.ctx.reporter

    @reporter.setter
    def reporter(self, reporter: Reporter) -> None:
        self.ctx.reporter = reporter

    @property
    def stream_round0(self) -> bool:
        return self._shard.stream_round0

    @stream_round0.setter
    def stream_round0(self, on: bool) -> None:
        self._shard.stream_round0 = on

    # -- shard (pipeline.steps.shard) ---------------------------------------------------

    async def shard(self) -> ShardSummary:
        """Reshard the input once (CPU): ids assigned where missing, duplicate ids reported.
        A call while the step runs in this process joins it; else it runs here."""
        return await self._shard.run()

    def start_shard(self) -> asyncio.Future[ShardSummary]:
        """Start the shard step as a task of its own, or join the one started (a new one after
        it failed). With ``stream_round0``, its layout pass feeds round 0 each shard it rewrites."""
        return self._shard.start()

    @property
    def streams_round0(self) -> bool:
        """Whether the shard step in this process feeds round 0 (not taken yet)."""
        return self._shard.streams

    async def shard_and_infer_first(self) -> None:
        """The shard step, and round 0's infer phase beside it when its layout pass streams;
        without a stream, the step alone. However round 0 ends, the shard step is waited for
        before this returns or raises: its thread is still writing ``sharded/``, and a retry
        must not start a second writer."""
        if not self._shard.may_stream() and self._shard.live() is None:
            await self.shard()  # nothing to stream: the step alone, in this task
            return
        task = self.start_shard()
        if not self.streams_round0 or task.done():
            await asyncio.shield(task)
            return
        try:
            await self.infer(0)
        except BaseException as exc:
            if not task.done():  # said now: the wait below is up to the rest of the rewrite (hours at scale)
                log.error("run %s: round 0 failed beside the layout pass (%s: %s); waiting for the pass to finish "
                          "writing %s, which a rerun then reuses", self.spec.run, type(exc).__name__, exc, self.layout.sharded)
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
            raise
        await asyncio.shield(task)

    # -- a round (pipeline.steps.rounds, .review, .decide) ---------------------------------

    async def infer(self, r: int) -> PhaseSummary:
        """pending(r) -> inferred(r), one output shard per pending shard."""
        return await self._infer.run(r, self.runner)

    async def judge(self, r: int) -> PhaseSummary:
        """inferred(r) -> results (approved) + rejected(r); checks approved + rejected == inferred."""
        return await self._judge.run(r, self.runner)

    def needs_review(self, r: int) -> bool:
        """Whether judge(r) sent records to people (sync, cheap: the ledger)."""
        return self._review.needed(r)

    def review_status(self, r: int, *, now: float | None = None) -> ReviewStatus:
        """Round ``r``'s review: done, left, by reviewer, age, whether it can close (blocking, sensor-safe)."""
        return self._review.status(r, now=now)

    async def resolve_review(self, r: int, *, now: float | None = None) -> ReviewSummary:
        """Close round ``r``'s review once its queue is empty or its timeout policy decides the rest
        (``gate.ReviewPending`` while records wait)."""
        return await asyncio.to_thread(self._review.resolve, r, now=now)

    async def wait_for_review(self, r: int) -> ReviewSummary:
        """Poll (``review.poll_s``) until round ``r``'s review can close, then close it; each look
        goes to the reporter's ``review_waiting(r, text, url)`` when it has one."""
        return await self._review.wait(r, self.reporter)

    def round_counts(self, r: int) -> dict[str, int]:
        """Every count of round ``r``, streamed from its shards (blocking)."""
        return self._review.round_counts(r)

    def decide(self, r: int) -> Decision:
        """What follows round ``r``: next_round, tail (hybrid), done, or exhausted. Sync and cheap."""
        return deciding.decide(self.ctx, r, self.eta)

    async def recompact(self, r: int) -> RecompactSummary:
        """rejected(r) -> pending(r + 1) in full shards."""
        return await deciding.recompact(self.ctx, r)

    # -- tail and finalize (pipeline.steps.tail, .finalize) ------------------------------

    async def tail(self, from_round: int) -> PhaseSummary:
        """Strategy 2 over pending(from_round): each record retried in place to approval or max_attempts."""
        return await tailing.tail(self.ctx, from_round, self.runner)

    async def finalize(self) -> RunSummary:
        """Write exhausted rows if the rounds hit their cap, check conservation, record the run."""
        return await asyncio.to_thread(ending.finalize, self.ctx)

    def quarantined(self) -> list[QuarantineEntry]:
        """Every quarantined shard entry of the run."""
        return ending.quarantined(self.ctx)

    def terminal_sources(self) -> list[IdSource]:
        """The id sets conservation is checked over: the input and every terminal state
        (``finalize`` checks these; Dagster's whole-run checks re-check them; blocking)."""
        return ending.terminal_sources(self.ctx)

    # -- whole steps for the Dagster assets (each asset calls one) ---------------------

    async def judged_round(self, r: int) -> JudgedRound:
        """Judge round ``r``, decide what follows it, and return everything about the round.
        A round that sent records to people is not decided yet: its ``review`` says where the
        queue stands (``resolve_review`` then ``decide`` follow once it is done)."""
        await self.judge(r)
        status = None
        if await asyncio.to_thread(self.needs_review, r):
            status = await asyncio.to_thread(self.review_status, r)
        else:
            await asyncio.to_thread(self.decide, r)
        return await asyncio.to_thread(ending.judged_round, self.ctx, r, status)

    async def sharded_input(self) -> StepOutcome:
        """``shard``, with the shards it committed (what the ``sharded`` asset shows)."""
        summary = await self.shard()
        return await asyncio.to_thread(ending.outcome, self.ctx, summary, summary.output_url)

    async def pending_round(self, r: int) -> StepOutcome:
        """Round ``r``'s input with its shards: round ``r - 1``'s rejected records repacked, or
        for round 0 the sharded input itself (its ``ShardSummary``)."""
        summary: Any = await self.recompact(r - 1) if r > 0 else None
        return await asyncio.to_thread(ending.outcome, self.ctx, summary, self.layout.pending(r))

    async def inferred_round(self, r: int) -> StepOutcome:
        """``infer``, with the output shards it wrote (what the ``inferred`` asset shows)."""
        summary = await self.infer(r)
        return await asyncio.to_thread(ending.outcome, self.ctx, summary, summary.output_url)

    async def tail_from(self, from_round: int) -> StepOutcome:
        """The tail as the sensor hands it over: repack round ``from_round - 1``'s rejected
        records first (``from_round`` 0: the sharded input), then retry them in place."""
        if from_round > 0:
            await self.recompact(from_round - 1)
        summary = await self.tail(from_round)
        return StepOutcome(summary, await asyncio.to_thread(self.ledger.view))

    async def finish(self) -> StepOutcome:
        """``finalize``, with the ledger and the result shards it proved."""
        summary = await self.finalize()
        return await asyncio.to_thread(ending.results_outcome, self.ctx, summary)
