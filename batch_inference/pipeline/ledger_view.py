"""The ledger read back, typed: one round's phases and figures (``RoundView``), the steps
still running (``StepProgress``), the whole ledger (``LedgerView``), and what the steps
return with it (``JudgedRound``, ``StepOutcome``).

``pipeline.summaries`` re-exports these with the step records (``pipeline.step_summaries``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from batch_inference.pipeline.counts import Counts
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.step_summaries import (
    Decision,
    PhaseSummary,
    QuarantineEntry,
    RecompactSummary,
    ReviewSummary,
    RunSummary,
    ShardSummary,
    _Summary,
    cache_hit_rate,
    prefill_vs_ideal,
    rate,
)
from batch_inference.pool.protocol import REVIEW_OUTPUT


@dataclass(frozen=True)
class RoundView:
    """One round as the ledger holds it, and its figures over both phases."""

    round: int
    infer: PhaseSummary | None = None
    judge: PhaseSummary | None = None
    decision: Decision | None = None
    recompact: RecompactSummary | None = None  # how pending(round + 1) was made from this round
    review: ReviewSummary | None = None  # the round's human review, once closed

    @property
    def phases(self) -> list[PhaseSummary]:
        return [p for p in (self.infer, self.judge) if p is not None]

    @property
    def records_in(self) -> int:
        """The round's pending records (those of infer-quarantined shards included)."""
        return self.infer.records_total if self.infer else 0

    @property
    def approved(self) -> int:
        """Approved by the judge, and by people once the round's review is closed."""
        return (self.judge.approved if self.judge else 0) + (self.review.approved if self.review else 0)

    @property
    def rejected(self) -> int:
        """Rejected records the next round (or the tail) retries, people's rejections included once
        the review is closed; a permanent error is failed, not rejected."""
        judged = self.judge.rejected - self.judge.permanent_errors if self.judge else 0
        return judged + (self.review.rejected if self.review else 0)

    @property
    def awaiting_review(self) -> int:
        """Records the judge sent to people while their review is open (0 once it is closed)."""
        return int(self.judge.counts.get(REVIEW_OUTPUT, 0)) if self.judge and self.review is None else 0

    @property
    def quarantined(self) -> list[QuarantineEntry]:
        return [q for p in self.phases for q in p.quarantined]

    @property
    def records_quarantined(self) -> int:
        return sum(q.records for q in self.quarantined)

    @property
    def failed(self) -> int:
        """Records that ended failed in this round: its quarantined shards' and its permanent errors."""
        return self.records_quarantined + (self.judge.permanent_errors if self.judge else 0)

    @property
    def approval(self) -> float:
        """Approved / the round's input: the share of its pending set it cleared."""
        return rate(self.approved, self.records_in)

    @property
    def output_tokens_per_s(self) -> float:
        """What the engine delivered in the round's inference phase (its generation)."""
        return self.infer.output_tokens_per_s if self.infer else 0.0

    @property
    def engine(self) -> dict[str, Any]:
        """The engine's occupancy while the round's inference phase ran."""
        return self.infer.engine if self.infer else {}

    @property
    def tokens_in(self) -> int:
        return sum(p.tokens_in for p in self.phases)

    @property
    def tokens_out(self) -> int:
        return sum(p.tokens_out for p in self.phases)

    @property
    def engine_busy_s(self) -> float:
        return sum(p.engine_busy_s for p in self.phases)

    @property
    def wall_s(self) -> float:
        return sum(p.wall_s for p in self.phases)

    @property
    def drain_s(self) -> float:
        return sum(p.drain_s for p in self.phases)

    @property
    def avg_fill(self) -> float:
        """The batch fill of the phase that used the engine most (a rule judge runs none)."""
        return max((p.avg_fill for p in self.phases), default=0.0)

    @property
    def duplicates(self) -> int:
        """Requests of the round answered by an identical one (both phases)."""
        return sum(p.duplicates for p in self.phases)

    @property
    def prefix_hit_rate(self) -> float | None:
        return cache_hit_rate(self.phases)

    @property
    def prefill_vs_ideal(self) -> float | None:
        return prefill_vs_ideal(self.phases)


@dataclass(frozen=True)
class StepProgress(_Summary):
    """A step whose shard tasks still run (no ledger entry yet): its finished tasks' progress
    records, and what its running tasks reported after their last chunk (``TaskSpec.progress_url``)."""

    step: str
    shards_done: int
    shards_running: int
    records_done: int  # records the finished tasks read
    records_running: int  # records the running tasks are through
    done: dict[str, int]  # the finished tasks' counts (approved, rejected, ok, error, ...)
    running: dict[str, int]  # the running tasks' counts so far
    committed: dict[str, int]  # of ``running``, those on storage already (a retry task's checkpoints): a cancel keeps them

    @property
    def records(self) -> int:
        return self.records_done + self.records_running


def add_counts(counts: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Counts by outcome summed over tasks, as a plain dict (``Counts.total``)."""
    return Counts.total(counts).as_dict()


@dataclass
class LedgerView:
    """Everything a run's ledger holds, typed (``Ledger.view()``)."""

    spec: dict[str, Any] | None
    shard: ShardSummary | None
    rounds: list[RoundView] = field(default_factory=list)
    tail: PhaseSummary | None = None  # its ``round`` is the round it took over from
    run: RunSummary | None = None
    steps: dict[str, StepProgress] = field(default_factory=dict)  # the steps under way, by ledger name

    def settled(self) -> dict[str, int]:
        """Records that reached a terminal state so far, and keep it whatever follows (a cancel
        delivers them): ``approved`` (the judges' committed shards, the tail's finished shards and
        its running tasks' checkpointed records) and ``failed`` (errors, max_attempts, quarantined
        shards). Moves per committed chunk of the tail, per finished shard of a round's judge."""
        approved = failed = 0
        for r in self.rounds:
            approved += r.approved
            failed += r.failed
            if r.judge is None and (judging := self.steps.get(RunLayout.step_name(r.round, "judge"))) is not None:
                approved += int(judging.done.get("approved", 0))
        if self.tail is not None:
            approved += self.tail.approved
            failed += self.tail.records_failed + self.tail.max_attempts
        elif (tail := self.steps.get(RunLayout.TAIL)) is not None:
            counts = Counts(tail.done) + tail.committed
            approved += counts.get("approved", 0)
            failed += counts.get("error", 0) + counts.get("max_attempts", 0)
        return {"approved": approved, "failed": failed}

    @property
    def quarantined(self) -> list[QuarantineEntry]:
        """Every quarantined shard of the run, rounds then tail."""
        return [q for r in self.rounds for q in r.quarantined] + (list(self.tail.quarantined) if self.tail else [])

    def as_dict(self) -> dict[str, Any]:
        def d(x: Any) -> Any:
            return x.as_dict() if x is not None else None

        return {"spec": self.spec, "shard": d(self.shard), "tail": d(self.tail), "run": d(self.run),
                "steps": {name: d(p) for name, p in self.steps.items()},
                "rounds": [{"round": r.round, "infer": d(r.infer), "judge": d(r.judge), "decision": d(r.decision),
                            "recompact": d(r.recompact), "review": d(r.review)} for r in self.rounds]}


@dataclass(frozen=True)
class JudgedRound:
    """What ``PipelineRun.judged_round`` returns: a judged round, what follows it, and its context."""

    round: RoundView  # both phases and the decision
    approved_shards: list[str]  # results/round-NN-part-* written by this round's judge
    view: LedgerView  # the whole ledger (the funnel so far)
    review: Any = None  # review.lifecycle.ReviewStatus while the round waits for people (then no decision yet)

    @property
    def decision(self) -> Decision:
        assert self.round.decision is not None, "a round waiting for review is not decided yet"
        return self.round.decision


@dataclass(frozen=True)
class StepOutcome:
    """A step's summary with the ledger after it (what an asset shows beside the summary)."""

    summary: Any  # ShardSummary, RecompactSummary, PhaseSummary (infer, tail) or RunSummary (finalize)
    view: LedgerView
    shards: list[str] = field(default_factory=list)  # the step's output shards, when it lists them
