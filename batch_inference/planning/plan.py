"""The planner: what a spec will cost and how long it will take, before it runs.

``make_plan(spec)`` reads the input's size (a shard directory's manifest, else a count or
a sample), tokenises a sample of prompts with the engine's own tokenizer, takes the
engine's per-record cost from an ``EngineProfile`` (measured on the target hardware by
``measure_profile``, i.e. ``batch-inference profile``, or derived from a calibrated
decode-step profile), and runs the scale simulation (``planning.simulation``) once per
strategy. Every number it prints says where it came from (``RunPlan.assumptions``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from batch_inference.engines.profiles import PROFILES, get_profile
from batch_inference.engines.simulated import simulated_text_tokens
from batch_inference.pipeline.report import duration
from batch_inference.pipeline.spec import PipelineSpec, engine_label
from batch_inference.planning.cluster import Cluster, Overheads
from batch_inference.planning.layout_cost import measure_layout
from batch_inference.planning.profiling import EngineProfile
from batch_inference.planning.rates import EngineRates, Workload, engine_rates
from batch_inference.planning.simulation import SimResult, simulate
from batch_inference.planning.sizing import (PREFIX_SAMPLE, as_run_records, input_size, predict_prefix, prefix_windows,
                                             prompt_token_counts, request_max_tokens)

STRATEGIES = ("rounds", "in_place", "hybrid")
DEFAULT_GPU_PROFILE = "h200-llama-8b"


@dataclass
class StrategyPlan:
    strategy: str
    wall_s: float
    engine_s: float
    gpu_hours: float
    cost: float | None
    waves: float
    approved: int
    unfinished: int
    tokens_in: float
    tokens_out: float
    idle_share: float
    decisions: list[str]
    phases: list[dict[str, Any]]
    # (low, high) wall over the approval's 95% interval when it was measured on a sample
    wall_band_s: tuple[float, float] | None = None
    # a judge with its own pool: each pool priced apart, {"infer"|"judge": {replicas, gpu_hours,
    # engine_hours, busy_share, cost}}; both are held for the whole run (persistent pools)
    pools: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, res: SimResult, w: Workload, price: float | None, judge_tokens: float, replicas: int) -> StrategyPlan:
        attempts = res.attempts
        pools = {name: {"replicas": int(p["replicas"]), "gpu_hours": p["gpu_s"] / 3600.0, "engine_hours": p["engine_s"] / 3600.0,
                        "busy_share": p["engine_s"] / p["gpu_s"] if p["gpu_s"] else 0.0,
                        "cost": p["gpu_s"] / 3600.0 * price if price is not None else None}
                 for name, p in res.pools.items()}
        return cls(pools=pools,
            strategy=res.strategy, wall_s=res.wall_s,
            engine_s=res.engine_s / max(1, sum(p["replicas"] for p in pools.values()) if pools else replicas),
            gpu_hours=res.gpu_hours(), cost=res.gpu_hours() * price if price is not None else None, waves=res.waves,
            approved=res.approved, unfinished=res.unfinished + res.quarantined,
            tokens_in=attempts * (w.prompt_tokens + judge_tokens), tokens_out=res.tokens_out + attempts * w.judge_output_tokens,
            idle_share=res.idle_share, decisions=[f"round {d.round}: {d.kind} ({d.reason})" for d in res.decisions],
            phases=[{"name": r.name, "records": r.records, "wall_s": round(r.wall_s, 2)} for r in res.rounds],
        )


@dataclass
class RunPlan:
    spec_run: str
    records: int
    replicas: int
    concurrency: int
    gpu_hour_price: float | None
    strategies: list[StrategyPlan]
    assumptions: list[str]
    chosen: str  # the spec's own strategy
    # the engine's prefix cache on the inferred prompts: predicted from the sample's prefix
    # structure, and what it saves the spec's strategy (against the same engine without it)
    prefix: dict[str, Any] | None = None
    # what the figures are for (the plan's first lines): the hardware and model priced, the spec's engine
    basis: list[str] = dataclasses.field(default_factory=list)

    def for_strategy(self, strategy: str) -> StrategyPlan:
        return next(s for s in self.strategies if s.strategy == strategy)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metadata(self) -> dict[str, Any]:
        """Flat figures for Dagster metadata and the ledger: the spec's strategy, planned."""
        s = self.for_strategy(self.chosen)
        out: dict[str, Any] = {
            "plan.strategy": s.strategy, "plan.records": self.records, "plan.wall_s": round(s.wall_s, 1),
            "plan.engine_s": round(s.engine_s, 1), "plan.gpu_hours": round(s.gpu_hours, 3), "plan.waves": round(s.waves, 2),
            "plan.tokens_out": round(s.tokens_out), "plan.approved": s.approved,
        }
        if s.cost is not None:
            out["plan.cost"] = round(s.cost, 2)
        if self.basis:
            out["plan.basis"] = "; ".join(self.basis)
        for name, pool in s.pools.items():
            out[f"plan.pool.{name}.gpu_hours"] = round(pool["gpu_hours"], 3)
            out[f"plan.pool.{name}.busy_share"] = round(pool["busy_share"], 3)
        if s.wall_band_s is not None:
            out["plan.wall_s.low"], out["plan.wall_s.high"] = (round(x, 1) for x in s.wall_band_s)
        for p in s.phases:
            if p.get("priced", True):  # an unpriced phase's guess is no figure to hold a run to
                out[f"plan.phase.{p['name']}.wall_s"] = p["wall_s"]
        if self.prefix is not None:
            for key in ("hit_rate", "ideal_hit_rate", "gpu_hours_saved", "cost_saved", "wall_s_saved"):
                if self.prefix.get(key) is not None:
                    out[f"plan.prefix.{key}"] = self.prefix[key]
        return out


def judge_prompt_tokens(spec: PipelineSpec, prompt: float, output: float) -> float:
    """Tokens of a judge prompt: the template's own text (~4 characters a token) plus the
    record's prompt and the result where it names them. A rule judge sends none.

    The result re-tokenised is as long as it was generated, except from the simulated
    engine, whose answer is words (one output token each) that its tokenizer counts at 4
    characters a token: 16 words quote as ~26 tokens (``simulated_text_tokens``)."""
    if spec.judge.kind != "llm" or not spec.judge.template:
        return 0.0
    t = spec.judge.template
    literal = re.sub(r"\{[^{}]*\}", "", t)
    result = simulated_text_tokens(output) if spec.engine.kind == "simulated" else output
    return len(literal) / 4 + (prompt if "{prompt}" in t else 0.0) + (result if "{result}" in t else 0.0)


def approval_bounds(w: Workload, profile: EngineProfile | None) -> tuple[Workload, Workload] | None:
    """The workload at the low and high ends of the measured approvals' 95% intervals
    (Wilson score), or None when the profile measured none."""
    judged = (profile.measured.get("judged") if profile is not None else None) or []
    if not judged or not judged[0]:
        return None

    def interval(p: float, n: int) -> tuple[float, float]:
        if n <= 0:
            return p, p
        z = 1.96
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return max(0.0, centre - half), min(1.0, centre + half)

    lo0, hi0 = interval(w.approval, int(judged[0]))
    later = w.retry_approval
    n1 = int(judged[1]) if len(judged) > 1 else 0
    lo1, hi1 = interval(later, n1) if later is not None else (None, None)
    return (dataclasses.replace(w, approval=lo0, retry_approval=lo1), dataclasses.replace(w, approval=hi0, retry_approval=hi1))


def linear_rates(spec: PipelineSpec, w: Workload) -> EngineRates:
    """Per-record engine time of the linear simulated engine under the worker's token budget."""
    o = spec.engine.simulated
    budget = int((spec.pool.batcher or {}).get("target_batch_tokens", 12_800))
    max_batch = int((spec.pool.batcher or {}).get("max_batch_size", 256))

    def per_record(prompt: float, out: float, max_tokens: int) -> float:
        per_batch = max(1, min(max_batch, math.ceil(budget / max(1.0, prompt + max_tokens))))
        return o.latency_b_s * (prompt + out) + o.latency_a_s / per_batch

    judge_prompt = w.judge_prompt_tokens if w.judge_prompt_tokens is not None else w.prompt_tokens + w.output_tokens + w.judge_extra_tokens
    infer = per_record(w.prompt_tokens, w.output_tokens, w.max_tokens)
    batch = max(1, min(max_batch, math.ceil(budget / max(1.0, w.prompt_tokens + w.max_tokens))))
    judge_batch = max(1, min(max_batch, math.ceil(budget / max(1.0, judge_prompt + w.judge_output_tokens))))
    return EngineRates(infer_s=infer, judge_s=per_record(judge_prompt, w.judge_output_tokens, w.judge_output_tokens),
                       infer_latency_s=0.0, judge_latency_s=0.0, infer_tokens_out=w.output_tokens,
                       steps_per_record=1 / batch, calls_per_record=1 / batch, scheduling="blocking", profile="simulated-linear",
                       call_s=o.latency_a_s, judge_calls_per_record=1 / judge_batch)


def cache_block_size(spec: PipelineSpec, gpu_profile: str | None) -> int | None:
    """The block size of the prefix cache the planned engine keeps, or None when it keeps none:
    a spec planned on a GPU profile (vLLM there), vLLM (unless ``enable_prefix_caching`` is
    off), the simulated decode engine with ``prefix_cache``; transformers keeps none."""
    cfg = spec.engine
    if gpu_profile is not None:
        return get_profile(gpu_profile).block_size
    if cfg.kind == "simulated":
        from batch_inference.engines.simulated import decode_profile

        return decode_profile(cfg.simulated).block_size if cfg.simulated.cost_model == "decode" and cfg.simulated.prefix_cache else None
    if cfg.kind == "vllm":
        if cfg.vllm.extra.get("enable_prefix_caching") is False:
            return None
        size = cfg.vllm.extra.get("block_size")
        return size if isinstance(size, int) and size > 0 else get_profile(DEFAULT_GPU_PROFILE).block_size
    return None


def judge_placement(spec: PipelineSpec, w: Workload, rates: EngineRates, profile: EngineProfile | None,
                    gpu_profile: str | None, gpus: int | None, notes: list[str]) -> tuple[Cluster, EngineRates] | None:
    """A judge with its own model: its pool's cluster and its engine's rates (None: it shares the infer pool).

    A measured profile ran the spec's own pipeline, its judge on the judge's pool: its
    judge figures are that pool's. Otherwise the judge engine is priced as the infer engine
    is: the simulated engine's linear cost, or a calibrated decode-step profile.
    """
    pool = spec.judge_pool
    if pool is None:
        return None
    engine = spec.judge_engine
    sim_opts = engine.simulated if engine.kind == "simulated" else None
    if profile is not None:
        judge_rates, how = rates, f"measured by the profile ({profile.source}) on the judge's pool"
    elif sim_opts is not None and sim_opts.cost_model == "linear" and gpu_profile is None:
        judge_rates, how = linear_rates(spec.model_copy(update={"engine": engine, "pool": pool}), w), "the judge engine's linear cost"
    else:
        name = gpu_profile or (sim_opts.profile if sim_opts is not None and sim_opts.cost_model == "decode" else DEFAULT_GPU_PROFILE)
        judge_rates, how = engine_rates(get_profile(name), w, sample=min(20_000, max(2_000, w.records))), f"decode-step profile {name}"
    replicas = gpus or pool.replicas
    cluster = (Cluster(replicas=1, concurrency=pool.concurrency * pool.replicas) if pool.launcher == "inprocess" and gpus is None
               else Cluster(replicas=replicas, concurrency=pool.concurrency))
    notes.append(f"judge: its own model {engine_label(engine)} on pool {pool.name} ({cluster.replicas} replica(s) x "
                 f"{cluster.concurrency} slots): {judge_rates.judge_s * 1000:.3f} ms per judged record ({how}); each phase "
                 "runs on its own pool and a tail task's generation and judging run at once (two chunks in flight, the next "
                 "generating while the one before is judged); each pool is held for the whole run "
                 "and priced apart" + (" (--gpus sizes both pools)" if gpus else "")
                 + "; the tail's judge waves' storage round trips (a shard per wave) are not priced")
    return cluster, judge_rates


def plan_basis(spec: PipelineSpec, profile: EngineProfile | None, gpu_profile: str | None) -> list[str]:
    """What a plan's figures are for, in words a user reads before the figures: the hardware
    and model its engine time is priced on, and the spec's own engine beside it.

    Without a profile a GPU spec is priced on the default calibrated profile (an H200 running
    Llama-3.1-8B), whatever its engine is: a plan of the tiny model on CPU said so nowhere
    near its figures (issue 28 item 4)."""
    spec_engine = f"the spec's engine: {spec.engine.kind}, model {engine_label(spec.engine)}"
    sim_opts = spec.engine.simulated if spec.engine.kind == "simulated" else None
    if profile is not None:
        return [f"priced for: the hardware and engine a profile measured ({profile.source})", spec_engine, *_judge_basis(spec)]
    if sim_opts is not None and sim_opts.cost_model == "linear" and gpu_profile is None:
        return ["priced for: the simulated engine's linear cost model (no hardware, no model: benchmarks only)", spec_engine,
                *_judge_basis(spec)]
    name = gpu_profile or (sim_opts.profile if sim_opts is not None and sim_opts.cost_model == "decode" else DEFAULT_GPU_PROFILE)
    prof = get_profile(name)
    if gpu_profile is not None:
        why = f"--engine-profile {name}"
    elif sim_opts is not None:
        why = f"the simulated engine's decode profile {name}"
    else:
        why = f"{name}, the default: no --profile or --engine-profile given"
    lines = [f"priced for: {prof.hardware or name} running {prof.model or name} (calibrated decode-step profile: {why})", spec_engine]
    if gpu_profile is None and sim_opts is None:
        lines[1] += (" -- not what these figures are for: measure it with `batch-inference profile SPEC` on the target "
                     f"hardware and pass --profile, or pick --engine-profile ({', '.join(sorted(PROFILES))})")
    return lines + _judge_basis(spec)


def _judge_basis(spec: PipelineSpec) -> list[str]:
    """A judge with its own model and pool: which, beside the infer engine's line."""
    if spec.judge_pool is None:
        return []
    return [f"the judge's engine: {spec.judge_engine.kind}, model {engine_label(spec.judge_engine)}, on its own pool "
            f"{spec.judge_pool.name} (priced as the judge assumption below says)"]


def assumed_phases(profile: EngineProfile | None, overheads: Overheads | None) -> list[str]:
    """The phases a plan does not price from a measurement (their names' first or last word):
    the CPU passes (resharding the input, recompacting a round's rejects) at a rate nobody
    measured. Their planned wall is a guess, so a run's actual wall is no miss against it
    (a 2,000-record shard step planned at 10 ms took 13 s: the step's fixed cost)."""
    if overheads is not None:  # given by the caller: priced as given
        return []
    measured = profile.overheads if profile is not None else {}
    return [name for key, name in (("reshard_records_per_s", "shard"), ("recompact_records_per_s", "recompact"))
            if key not in measured]


def local_overheads(spec: PipelineSpec) -> Overheads:
    """Latencies of the launcher the spec names: nothing to launch in process or locally."""
    if spec.pool.launcher == "k8s":
        return Overheads(retries=spec.pool.retries, checkpoint_interval_s=spec.pool.checkpoint_interval_s)
    # progress_read_s: local disk, bench/ledger_overhead.py --store local
    return Overheads(task_s=0.05, driver_task_s=0.002, progress_read_s=0.00015, phase_launch_s=0.0, round_gap_s=0.0,
                     list_page_s=0.01, object_s=0.01, restart_s=10.0, retries=spec.pool.retries, checkpoint_interval_s=spec.pool.checkpoint_interval_s)


def layout_overheads(spec: PipelineSpec, o: Overheads, sample: list[dict[str, Any]], records: int, *, applies: bool,
                     streams: bool, notes: list[str]) -> Overheads:
    """``o`` with the layout pass priced from its run over ``sample`` (``planning.layout_cost``),
    and a line saying so; ``applies``: the input's windows share prefixes (``sample`` is
    theirs), so the pass's tokenising half is priced (else the text gate alone, what a run
    that keeps its order pays)."""
    cost = measure_layout(spec, sample, applies=applies)
    if cost is None:
        return o
    o = dataclasses.replace(o, **cost.overheads(spec, records))
    spread, rewrite = records * o.layout_record_s / max(1, o.layout_workers), records * o.layout_serial_record_s
    held = (f"{duration(spread)} with the pool open and every GPU idle, then {duration(rewrite)} of merging and rewriting "
            "beside round 0, which starts on its shards as they are written (layout.stream; the in-place strategy "
            "and Dagster's steps wait for the whole pass)" if streams
            else f"{duration(spread + rewrite)} with the pool open and every GPU idle")
    notes.append(f"layout pass: {cost.spread_record_s * 1e6:,.0f} us a record signing ({cost.signature}"
                 f"{'' if cost.applied else ', the text gate alone: no prefix shared in the sample'}) over "
                 f"{o.layout_workers} process(es) (layout.workers; the driver's cores here), "
                 f"{cost.serial_record_s * 1e6:,.0f} us a record in the driver (reading, merging, rewriting), "
                 f"measured on {cost.records:,} sample records spilled as {cost.runs} sorted runs: {held}")
    return o


def make_plan(
    spec: PipelineSpec,
    *,
    gpus: int | None = None,
    gpu_hour_price: float | None = None,
    profile: EngineProfile | None = None,
    gpu_profile: str | None = None,
    approval: float | None = None,
    records: int | None = None,
    sample: int = 500,
    prefix_sample: int = PREFIX_SAMPLE,
    overheads: Overheads | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
    stream_round0: bool | None = None,
) -> RunPlan:
    """Plan ``spec`` for each of ``strategies`` (the spec's own is ``RunPlan.chosen``; keep it in them).
    ``stream_round0``: whether round 0 starts beside the layout pass (None: ``layout.stream``,
    as a whole run driven by one process does; Dagster's steps run the shard step first)."""
    notes: list[str] = []
    size = input_size(spec, sample=sample)
    n = records if records is not None else size.records
    if records is None and size.account is not None and (size.account.malformed or size.account.duplicate_ids):
        notes.append(f"input: {size.account.summary()} ({size.how})")
        notes += [f"input: {note}" for note in size.account.notes()]
    else:
        notes.append(f"input: {n:,} records ({'given' if records is not None else size.how})")
    sample, fmt = as_run_records(spec, size.sample)
    counts, how, _ = prompt_token_counts(spec, sample)
    if fmt == "openai_batch":
        how += ", the OpenAI Batch requests' bodies"
    prompt_mean = sum(counts) / len(counts) if counts else (profile.prompt_tokens if profile and profile.prompt_tokens else 100.0)
    notes.append(f"prompt tokens: mean {prompt_mean:.1f} over {len(counts)} sample records ({how})")
    prefix = None
    layout_sample = sample  # records the layout pass is timed on: the windows' when they share prefixes
    if (block_size := cache_block_size(spec, gpu_profile)) is not None:
        window, where = prefix_windows(spec, prefix_sample)
        window, _ = as_run_records(spec, window)
        wcounts, _, blocks = prompt_token_counts(spec, window, block_size=block_size)
        prefix = predict_prefix(wcounts, blocks, block_size)
        if prefix is not None:
            layout_sample = window
        if prefix is not None:
            notes.append(f"prefix structure: over {prefix.sample:,} records ({where}), {prefix.share:.1%} of prompt tokens "
                         f"lie in {block_size}-token blocks other records share, ~{prefix.family:,.1f} records per shared prefix: "
                         f"an ideal prefix-cache hit rate of {prefix.hit_rate:.1%} (sharing between records further apart is not "
                         "seen: a lower bound unless the input is in prefix order); "
                         + ("families adjacent, as the prefix-aware layout orders them (layout.prefix)" if spec.layout.prefix
                            else "families spread through the input (layout.prefix off)"))
        else:
            notes.append(f"prefix structure: no {block_size}-token block repeats over {len(window):,} records ({where}): "
                         "no prefix-cache saving planned")
    # each request's own max_tokens: the spec's, or a record's override (an OpenAI Batch request's body)
    limits = request_max_tokens(spec, sample) or [spec.infer.sampling.max_tokens]
    max_tokens = max(limits)
    own = any(m != spec.infer.sampling.max_tokens for m in limits)
    sim_opts = spec.engine.simulated if spec.engine.kind == "simulated" else None
    if profile is not None and profile.output_tokens is not None:
        out_mean, out_how = profile.output_tokens, f"measured by the profile ({profile.source})"
    elif sim_opts is not None:
        out_mean = sum(min(sim_opts.output_tokens, m) for m in limits) / len(limits)
        out_how = "the simulated engine's output_tokens" + (", within each request's own max_tokens" if own else "")
    elif own:
        out_mean = sum(limits) / len(limits)
        out_how = (f"the mean of the sample requests' own max_tokens (up to {max_tokens:,}): an upper bound, "
                   "run `batch-inference profile` to measure")
    else:
        out_mean, out_how = float(max_tokens), "max_tokens (an upper bound: run `batch-inference profile` to measure)"
    notes.append(f"output tokens: mean {out_mean:.1f} per inference ({out_how})")
    a_later: float | None = None
    if approval is not None:
        a, a_how = approval, "given"
    elif profile is not None and profile.approval is not None:
        a, a_how = profile.approval, "measured by the profile"
        a_later = profile.retry_approval
    elif spec.judge_engine.kind == "simulated" and spec.judge.kind == "llm":
        a, a_how = spec.judge_engine.simulated.approval_rate, "the simulated judge's approval_rate"
    else:
        a, a_how = 0.5, "assumed (pass --approval or run `batch-inference profile`)"
    if a_later is None:
        notes.append(f"approval per attempt: {a:.3f} ({a_how}), independent across attempts")
    else:
        notes.append(f"approval: {a:.3f} on a record's first attempt, {a_later:.3f} on a later one ({a_how})")
    judge_tokens = judge_prompt_tokens(spec, prompt_mean, out_mean)
    w = Workload(records=n, prompt_tokens=max(1.0, prompt_mean), output_tokens=max(1.0, out_mean), judge_prompt_tokens=judge_tokens,
                 output_lengths=(sim_opts.output_lengths if sim_opts is not None else "geometric"),
                 max_tokens=max_tokens, judge_output_tokens=spec.judge.max_tokens if spec.judge.kind == "llm" else 1,
                 approval=a, retry_approval=a_later,
                 prefix_share=prefix.share if prefix else 0.0, prefix_family=prefix.family if prefix else 1.0,
                 prefix_layout="grouped" if spec.layout.prefix else "interleaved")
    uncached: EngineRates | None = None
    if profile is not None:
        rates = profile.rates()
        notes.append(f"engine: measured profile {profile.source}: {profile.infer_s * 1000:.3f} ms per inferred record, "
                     f"{profile.judge_s * 1000:.3f} ms per judged record, {profile.tail_attempt_s * 1000:.3f} ms per "
                     "in-place attempt (one replica at full load)")
    elif sim_opts is not None and sim_opts.cost_model == "linear" and gpu_profile is None:
        rates = linear_rates(spec, w)
        notes.append(f"engine: the simulated engine's linear cost ({duration(sim_opts.latency_a_s)} + {duration(sim_opts.latency_b_s)}/token per "
                     f"batch, the batcher's token budget): {rates.infer_s * 1000:.3f} ms per inferred record, "
                     f"{rates.judge_s * 1000:.3f} ms per judged record at full batches; the in-place tail's waves are "
                     f"chunk-sized ({spec.chunk_size} records at most), each call's {duration(sim_opts.latency_a_s)} "
                     "over that wave's records; engine time only (no pipeline overhead: profile for that)")
    else:
        name = gpu_profile or (sim_opts.profile if sim_opts is not None and sim_opts.cost_model == "decode" else DEFAULT_GPU_PROFILE)
        prof = get_profile(name)
        rate_sample = min(5_000 if prefix else 20_000, max(2_000, n))
        rates = engine_rates(prof, w, sample=rate_sample)
        notes.append(f"engine: calibrated decode-step profile {name} ({prof.source}), continuous batching: "
                     f"{rates.infer_s * 1000:.3f} ms per inferred record, {rates.judge_s * 1000:.3f} ms per judged record per replica")
        if prefix is not None:
            uncached = engine_rates(prof, w, sample=rate_sample, prefix_cache=False)
            notes.append(f"prefix cache: the decode model's LRU prefix cache (blocks pinned while their sequences run, the "
                         f"rest least recently used first out) supplies {rates.prefix_hit_rate:.1%} of inferred prompt "
                         f"tokens: {rates.infer_s * 1000:.3f} ms per inferred record against {uncached.infer_s * 1000:.3f} "
                         "without it")
    if spec.cache.enabled:  # the result cache (docs/cache.md): what earlier runs computed is not predictable from the input
        notes.append("result cache: no hit priced: every request is priced as the engine computing it (a profile measures "
                     "engine work only, its runs never read the cache); a rerun of records an earlier run under this output "
                     "computed with the same model and sampling takes less than planned")
    if prefix is not None and uncached is None:
        notes.append("prefix cache: not priced (the engine's cost here is measured or linear, its cache already in it or "
                     "not modelled; plan on a decode-step profile, --engine-profile, for the saving)")
    replicas = gpus or spec.pool.replicas
    if spec.pool.launcher == "inprocess" and gpus is None:
        cluster = Cluster(replicas=1, concurrency=spec.pool.concurrency * spec.pool.replicas)
    else:
        cluster = Cluster(replicas=replicas, concurrency=spec.pool.concurrency)
    o = overheads or local_overheads(spec)
    if profile is not None and profile.overheads:
        o = dataclasses.replace(o, **profile.overheads)
    if overheads is None or not (overheads.layout_record_s or overheads.layout_serial_record_s):
        o = layout_overheads(spec, o, layout_sample, n, applies=prefix is not None, notes=notes,
                             streams=spec.layout.stream if stream_round0 is None else stream_round0)
    notes.append(f"cluster: {cluster.replicas} replica(s) x {cluster.concurrency} slots; overheads: task {duration(o.task_s)}, "
                 f"phase launch {duration(o.phase_launch_s)}, round gap {duration(o.round_gap_s)}, "
                 f"recompaction {o.recompact_records_per_s:,.0f} rec/s, "
                 f"resharding {o.reshard_records_per_s:,.0f} rec/s")
    judged_on = judge_placement(spec, w, rates, profile, gpu_profile, gpus, notes)
    judge_cluster, judge_rates = judged_on if judged_on is not None else (None, None)
    if gpu_hour_price is not None:
        notes.append(f"cost: GPU-hours (replicas x wall from the first phase{', each pool' if judged_on else ''}) x "
                     f"{gpu_hour_price}/GPU-hour")
    bounds = approval_bounds(w, profile) if approval is None else None
    if bounds is not None:
        notes.append(f"band: the wall with approval at the ends of its 95% interval over the profile's "
                     f"{sum(profile.measured.get('judged', [])):,} judged records (engine-time noise is not in it)")
    unpriced = assumed_phases(profile, overheads)
    if unpriced:
        rates_of = {"shard": f"the shard phase (resharding at an assumed {o.reshard_records_per_s:,.0f} rec/s)",
                    "recompact": f"the recompact phases (at an assumed {o.recompact_records_per_s:,.0f} rec/s)"}
        notes.append(f"not priced: {' and '.join(rates_of[u] for u in unpriced)}: a guess, not measured "
                     "(`batch-inference profile` measures them); status shows them unpriced, not as a miss")
    plans = []
    for strategy in strategies:
        s = spec.model_copy(update={"strategy": strategy})
        res = simulate(s, w, rates, cluster=cluster, overheads=o, judge_cluster=judge_cluster, judge_rates=judge_rates,
                       stream_round0=stream_round0)
        plan = StrategyPlan.of(res, w, gpu_hour_price, judge_tokens, cluster.replicas)
        for phase in plan.phases:
            phase["priced"] = not any(phase["name"].startswith(u) or phase["name"].endswith(u) for u in unpriced)
        if bounds is not None:
            walls = sorted(simulate(s, b, rates, cluster=cluster, overheads=o, judge_cluster=judge_cluster,
                                    judge_rates=judge_rates, stream_round0=stream_round0).wall_s for b in bounds)
            plan.wall_band_s = (min(walls[0], res.wall_s), max(walls[-1], res.wall_s))
        plans.append(plan)
    saving: dict[str, Any] | None = None
    if prefix is not None:
        saving: dict[str, Any] = {"ideal_hit_rate": round(prefix.hit_rate, 4), "share": round(prefix.share, 4),
                                  "family": round(prefix.family, 2), "sample": prefix.sample, "block_size": prefix.block_size}
        if uncached is not None:
            chosen = next(p for p in plans if p.strategy == spec.strategy) if spec.strategy in strategies else plans[0]
            res = simulate(spec.model_copy(update={"strategy": chosen.strategy}), w, uncached, cluster=cluster, overheads=o,
                           judge_cluster=judge_cluster, judge_rates=judge_rates, stream_round0=stream_round0)
            without = StrategyPlan.of(res, w, gpu_hour_price, judge_tokens, cluster.replicas)
            saving.update(hit_rate=round(rates.prefix_hit_rate, 4), strategy=chosen.strategy,
                          gpu_hours_without=round(without.gpu_hours, 3), gpu_hours_saved=round(without.gpu_hours - chosen.gpu_hours, 3),
                          wall_s_saved=round(without.wall_s - chosen.wall_s, 1),
                          cost_saved=round(without.cost - chosen.cost, 2) if without.cost is not None and chosen.cost is not None else None)
    return RunPlan(spec.run, n, cluster.replicas, cluster.concurrency, gpu_hour_price, plans, notes, spec.strategy, saving,
                   basis=plan_basis(spec, profile, gpu_profile))
