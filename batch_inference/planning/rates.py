"""The engine-rate model: what a workload costs one replica, from the decode-step model.

``Workload`` is what is run (records, token shapes, the judge, the approval rate);
``EngineRates`` the engine-seconds per record at saturation that the simulated cluster
spends; ``engine_rates`` measures them on ``engines.decode_model`` over a sample of records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batch_inference.engines.decode_model import (
    DecodeProfile,
    draw_output_tokens,
    record_rng,
    run_blocking,
    run_continuous,
    token_budget_batches,
)


@dataclass(frozen=True)
class Workload:
    """What is being run: record count, token shapes, the judge, the approval rate."""

    records: int = 100_000_000
    prompt_tokens: float = 220.0  # mean, geometric
    output_tokens: float = 134.0  # mean before the cap
    output_lengths: Literal["fixed", "geometric", "pareto"] = "geometric"
    max_tokens: int = 256
    judge_extra_tokens: int = 30  # the judge template around prompt + result
    judge_prompt_tokens: float | None = None  # when known (the planner counts it): replaces prompt + output + extra
    judge_output_tokens: int = 4
    approval: float = 0.9  # P(approved) on a record's first attempt
    # P(approved) on each later attempt of a record rejected before. Rejection is rarely
    # independent across attempts (a hard record stays hard; greedy sampling repeats
    # itself): None means the same as ``approval``.
    retry_approval: float | None = None

    @property
    def later_approval(self) -> float:
        return self.approval if self.retry_approval is None else self.retry_approval

    def attempts(self, attempts_left: int, *, first: bool) -> tuple[float, float]:
        """(mean attempts, P(approved within them)) of a record with ``attempts_left`` attempts;
        ``first``: its next attempt is its first (else every attempt is a retry)."""
        if attempts_left <= 0:
            return 0.0, 0.0
        a1 = self.approval if first else self.later_approval
        a = self.later_approval
        rest = attempts_left - 1
        fail_later = (1 - a) ** rest
        mean_later = rest if a <= 0 else (1 - fail_later) / a
        return 1 + (1 - a1) * mean_later, 1 - (1 - a1) * fail_later


@dataclass(frozen=True)
class EngineRates:
    """Engine-seconds per record at saturation (one replica), from the decode model."""

    infer_s: float
    judge_s: float
    infer_latency_s: float  # one record's decode: the latency chain a task ends with
    judge_latency_s: float
    infer_tokens_out: float  # mean output tokens per record
    steps_per_record: float  # engine steps (continuous) or calls (blocking) per inferred record
    calls_per_record: float  # what one blocking generate() per token-budgeted batch would take
    scheduling: str
    profile: str
    tail_attempt_s: float = 0.0  # one in-place record-attempt when measured (else infer + judge)

    @property
    def per_attempt_s(self) -> float:
        return self.tail_attempt_s or (self.infer_s + self.judge_s)


def engine_rates(
    profile: DecodeProfile,
    workload: Workload,
    *,
    scheduling: Literal["continuous", "blocking"] = "continuous",
    target_batch_tokens: int = 12_800,
    max_batch_size: int = 256,
    sample: int = 20_000,
) -> EngineRates:
    """Measure the workload on the decode model (a sample of records, virtual time)."""
    w = workload
    infer = []
    judge = []
    for i in range(sample):
        p = draw_output_tokens(record_rng("plan", "p", i), "geometric", w.prompt_tokens, max_tokens=1 << 20)
        o = draw_output_tokens(record_rng("plan", "o", i), w.output_lengths, w.output_tokens, max_tokens=w.max_tokens)
        infer.append((p, o))
        jp = round(w.judge_prompt_tokens) if w.judge_prompt_tokens is not None else p + o + w.judge_extra_tokens
        judge.append((max(1, jp), w.judge_output_tokens))
    budget = token_budget_batches(infer, target_tokens=target_batch_tokens, max_tokens=w.max_tokens, max_batch_size=max_batch_size)
    if scheduling == "continuous":
        ri = run_continuous(profile, infer, max_in_flight=2 * profile.max_num_seqs)
        rj = run_continuous(profile, judge, max_in_flight=2 * profile.max_num_seqs)
        steps = ri.steps / sample
    else:
        ri = run_blocking(profile, budget)
        rj = run_blocking(profile, token_budget_batches(judge, target_tokens=target_batch_tokens,
                                                        max_tokens=w.judge_output_tokens, max_batch_size=max_batch_size))
        steps = len(budget) / sample
    step_i = ri.seconds / max(1, ri.steps)
    step_j = rj.seconds / max(1, rj.steps)
    mean_out = sum(o for _, o in infer) / sample
    return EngineRates(
        infer_s=ri.seconds / sample, judge_s=rj.seconds / sample,
        infer_latency_s=step_i * mean_out, judge_latency_s=step_j * w.judge_output_tokens,
        infer_tokens_out=mean_out, steps_per_record=steps, calls_per_record=len(budget) / sample,
        scheduling=scheduling, profile=profile.name,
    )
