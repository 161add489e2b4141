"""The engine-rate model: what a workload costs one replica, from the decode-step model.

``Workload`` is what is run (records, token shapes, the judge, the approval rate);
``EngineRates`` the engine-seconds per record at saturation that the simulated cluster
spends; ``engine_rates`` measures them on ``engines.decode_model`` over a sample of records.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

from batch_inference.engines.blocks import cacheable_blocks
from batch_inference.engines.decode_model import run_blocking, run_continuous, token_budget_batches
from batch_inference.engines.lengths import draw_output_tokens, record_rng
from batch_inference.engines.prefix_cache import PrefixCache
from batch_inference.engines.profiles import DecodeProfile


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
    # Prefix structure: the share of a record's prompt tokens that lead it and that it shares
    # with the other records of its family (a document asked several questions, a few-shot
    # block per task), families of ``prefix_family`` records; ``grouped``: a family's
    # records reach the engine together (the prefix-aware layout), ``interleaved``: spread
    # through the whole input (input order, scattered over replicas).
    prefix_share: float = 0.0
    prefix_family: float = 1.0
    prefix_layout: Literal["grouped", "interleaved"] = "grouped"
    # the judge prompt leads with the record's prompt (a template "{prompt} ..."): its family
    # prefix is cached for the judge phase too
    judge_prefix: bool = False

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

    def tail_waves(self, attempts_left: int, chunk: int, *, first: bool) -> float:
        """Expected waves a chunk of ``chunk`` records goes through in place (each wave: one
        generate call over the chunk's samples still needing inference, then one judge call).

        Wave k exists when any of the chunk's records reaches its k-th attempt: with records
        independent, ``1 - (1 - q_k) ** chunk`` where q_k is one record's chance to.
        """
        if attempts_left <= 0 or chunk <= 0:
            return 0.0
        a1 = self.approval if first else self.later_approval
        reach, total = 1.0, 0.0
        for k in range(attempts_left):
            total += 1 - (1 - reach) ** chunk
            reach *= (1 - a1) if k == 0 else (1 - self.later_approval)
        return total


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
    prefix_hit_rate: float = 0.0  # prompt tokens of the inferred records the engine's prefix cache supplied
    judge_prefix_hit_rate: float = 0.0  # the same for the judged records
    # The fixed cost of one engine call (the linear engine's per-batch ``a``), already spread
    # over a full batch in infer_s / judge_s (calls_per_record, judge_calls_per_record): the
    # tail's waves are chunk-sized, so each of their calls carries it over fewer records
    # (simulation prices them so). 0 where it is not known apart (a measured profile, the
    # decode-step model's continuous batching).
    call_s: float = 0.0
    judge_calls_per_record: float = 0.0

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
    prefix_cache: bool = True,
) -> EngineRates:
    """Measure the workload on the decode model (a sample of records, virtual time).

    With a prefix structure (``prefix_share``) the engine keeps vLLM's prefix cache unless
    ``prefix_cache`` is off (the same prompts, every token prefilled: what the cache saves).
    """
    w = workload
    infer = []
    for i in range(sample):
        p = draw_output_tokens(record_rng("plan", "p", i), "geometric", w.prompt_tokens, max_tokens=1 << 20)
        o = draw_output_tokens(record_rng("plan", "o", i), w.output_lengths, w.output_tokens, max_tokens=w.max_tokens)
        infer.append((p, o))
    shaped: list[Any] = infer
    if w.prefix_share > 0:
        shaped = prefix_requests(infer, w, profile.block_size)
        infer = [(p, o) for p, o, _ in shaped]
    judge: list[Any] = [(max(1, round(w.judge_prompt_tokens) if w.judge_prompt_tokens is not None else p + o + w.judge_extra_tokens),
                         w.judge_output_tokens) for p, o in infer]
    cache = PrefixCache(profile.block_size) if w.prefix_share > 0 and prefix_cache else None
    judge_cache = None
    if cache is not None and w.judge_prefix:
        judge_cache = PrefixCache(profile.block_size)
        judge = [(jp, jo, judge_keys(keys, jp, profile.block_size, i)) for i, ((jp, jo), (_, _, keys)) in enumerate(zip(judge, shaped))]
    budget = token_budget_batches(infer, target_tokens=target_batch_tokens, max_tokens=w.max_tokens, max_batch_size=max_batch_size)
    if scheduling == "continuous":
        ri = run_continuous(profile, shaped, max_in_flight=2 * profile.max_num_seqs, cache=cache)
        rj = run_continuous(profile, judge, max_in_flight=2 * profile.max_num_seqs, cache=judge_cache)
        steps = ri.steps / sample
    else:
        starts = [0, *itertools.accumulate(len(b) for b in budget)]
        ri = run_blocking(profile, [shaped[starts[k]:starts[k + 1]] for k in range(len(budget))], cache=cache)
        jbudget = token_budget_batches([r[:2] for r in judge], target_tokens=target_batch_tokens,
                                       max_tokens=w.judge_output_tokens, max_batch_size=max_batch_size)
        jstarts = [0, *itertools.accumulate(len(b) for b in jbudget)]
        rj = run_blocking(profile, [judge[jstarts[k]:jstarts[k + 1]] for k in range(len(jbudget))], cache=judge_cache)
        steps = len(budget) / sample
    step_i = ri.seconds / max(1, ri.steps)
    step_j = rj.seconds / max(1, rj.steps)
    mean_out = sum(o for _, o in infer) / sample
    return EngineRates(
        infer_s=ri.seconds / sample, judge_s=rj.seconds / sample,
        infer_latency_s=step_i * mean_out, judge_latency_s=step_j * w.judge_output_tokens,
        infer_tokens_out=mean_out, steps_per_record=steps, calls_per_record=len(budget) / sample,
        scheduling=scheduling, profile=profile.name,
        prefix_hit_rate=ri.cached_tokens / max(1, sum(p for p, _ in infer)),
        judge_prefix_hit_rate=rj.cached_tokens / max(1, sum(r[0] for r in judge)),
    )


def judge_keys(record_keys: list[bytes], judge_tokens: int, block_size: int, index: int) -> list[bytes]:
    """A judge prompt that leads with its record's prompt: the record's blocks, then its own."""
    n = cacheable_blocks(judge_tokens, block_size)
    keys = list(record_keys[:n])
    return keys + [f"j{index}:{j}".encode() for j in range(n - len(keys))]


def prefix_requests(requests: list[tuple[int, int]], w: Workload, block_size: int) -> list[tuple[int, int, list[bytes]]]:
    """The requests shaped by the workload's prefix structure, with the prefix cache's block keys.

    Every family's shared prefix is ``prefix_share x prompt_tokens`` long (one length, so a
    sample that sees a single large family is still representative); a record's prompt is
    its family's prefix followed by ``1 - prefix_share`` of its own drawn length, so the mean
    prompt stays ``prompt_tokens``.
    Its cacheable blocks inside the family prefix have the family's keys, the rest its own.
    ``grouped``: records ``i // family`` form a family, one after another; ``interleaved``:
    each record's family is drawn at random among the whole input's ``records / family``
    families (so at scale a family member rarely meets another while its blocks are cached).
    """
    families = max(1, round(w.records / max(1.0, w.prefix_family)))
    shared = max(1, round(w.prefix_share * w.prompt_tokens))
    out = []
    for i, (p, o) in enumerate(requests):
        f = int(i // max(1.0, w.prefix_family)) if w.prefix_layout == "grouped" else record_rng("family", i).randrange(families)
        prompt = shared + max(1, round(p * (1 - w.prefix_share)))
        n = cacheable_blocks(prompt, block_size)
        own = min(n, shared // block_size)
        keys = [f"f{f}:{j}".encode() for j in range(own)] + [f"r{i}:{j}".encode() for j in range(own, n)]
        out.append((prompt, o, keys))
    return out
