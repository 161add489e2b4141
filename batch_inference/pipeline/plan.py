"""The planner: what a spec will cost and how long it will take, before it runs.

``make_plan(spec)`` reads the input's size (a shard directory's manifest, else a count or
a sample), tokenises a sample of prompts with the engine's own tokenizer, takes the
engine's per-record cost from an ``EngineProfile`` (measured on the target hardware by
``measure_profile``, i.e. ``batch-inference profile``, or derived from a calibrated
decode-step profile), and runs the scale simulation (``pipeline.scale``) once per
strategy. Every number it prints says where it came from (``RunPlan.assumptions``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import platform
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batch_inference.engines.decode_model import PROFILES, get_profile
from batch_inference.pipeline.crossover import expected_attempts
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.scale import Cluster, EngineRates, Overheads, SimResult, Workload, engine_rates, simulate
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.summaries import PhaseSummary
from batch_inference.storage import JsonlDir, JsonlFile

STRATEGIES = ("rounds", "in_place", "hybrid")
DEFAULT_GPU_PROFILE = "h200-llama-8b"


# -- the engine profile file ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineProfile:
    """Per-record costs of one replica on the target hardware, and what was measured with them.

    ``infer_s``/``judge_s`` are seconds of one replica per record at full load (for a
    measured profile: phase wall x workers / records, so everything on the task path is
    in it); ``tail_attempt_s`` one in-place record-attempt (infer + judge + checkpoint).
    """

    source: str
    infer_s: float
    judge_s: float
    tail_attempt_s: float
    infer_latency_s: float = 0.0
    judge_latency_s: float = 0.0
    output_tokens: float | None = None  # mean per inferred record
    approval: float | None = None  # measured P(approved) per attempt
    prompt_tokens: float | None = None
    overheads: dict[str, float] = field(default_factory=dict)  # Overheads fields measured with it
    measured: dict[str, Any] = field(default_factory=dict)  # the raw figures

    def rates(self, calls_per_record: float = 0.0) -> EngineRates:
        return EngineRates(
            infer_s=self.infer_s, judge_s=self.judge_s, infer_latency_s=self.infer_latency_s,
            judge_latency_s=self.judge_latency_s, infer_tokens_out=self.output_tokens or 0.0,
            steps_per_record=calls_per_record, calls_per_record=calls_per_record,
            scheduling="measured", profile=self.source, tail_attempt_s=self.tail_attempt_s,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> EngineProfile:
        data = json.loads(Path(path).read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{path}: not an engine profile (unknown keys {sorted(unknown)})")
        return cls(**data)


# -- what the input and the prompts look like ---------------------------------------------------


@dataclass(frozen=True)
class InputSize:
    records: int
    how: str  # "manifest" | "counted" | "estimated from N records"
    sample: list[dict[str, Any]]


def input_size(spec: PipelineSpec, *, sample: int = 500, count_limit_bytes: int = 256 << 20) -> InputSize:
    """The input's record count (manifest, count, or estimate) and its first ``sample`` records."""
    opts = spec.storage_options or None
    src = spec.input
    d = JsonlDir(src, storage_options=opts)
    if d.exists_sync() and not src.endswith((".jsonl", ".jsonl.zst")):
        man = d.manifest()
        records = [r for _, r in zip(range(sample), d.iter_records_sync())]
        if man is not None:
            return InputSize(man.records, "manifest", records)
        return InputSize(d.count_records(), "counted", records)
    f = JsonlFile(src, storage_options=opts)
    import fsspec

    fs, path = fsspec.core.url_to_fs(src, **(opts or {}))
    stored = int(fs.size(path))
    if stored <= count_limit_bytes:
        recs: list[dict[str, Any]] = []
        n = 0
        for rec in f.iter_records_sync():
            if n < sample:
                recs.append(rec)
            n += 1
        return InputSize(n, "counted", recs)
    head = [r for _, r in zip(range(max(sample, 5_000)), f.iter_records_sync())]
    raw = b"".join(json.dumps(r).encode() + b"\n" for r in head)
    if f.compressed:
        import zstandard

        ratio = len(raw) / max(1, len(zstandard.ZstdCompressor(level=3).compress(raw)))
    else:
        ratio = 1.0
    est = int(stored * ratio / (len(raw) / max(1, len(head))))
    return InputSize(est, f"estimated from the first {len(head):,} records and the stored size", head[:sample])


def prompt_token_counts(spec: PipelineSpec, records: list[dict[str, Any]]) -> tuple[list[int], str]:
    """Prompt tokens of each sample record, through the engine's own tokenizer."""
    from batch_inference.prompting import RequestBuilder

    builder = RequestBuilder(spec.infer)
    prompts = []
    for rec in records:
        try:
            prompts.append(builder.prompt(rec))
        except (ValueError, KeyError):
            continue  # a bad record fails at run time with its reason; it costs nothing here
    if not prompts:
        return [], "no sample record renders a prompt"
    cfg = spec.engine
    if cfg.kind == "simulated":
        from batch_inference.engines.simulated import LinearSimulatedEngine

        return LinearSimulatedEngine(cfg.simulated).count_tokens(prompts), "the simulated engine's tokenizer"
    from transformers import AutoTokenizer

    from batch_inference.engines.chat import encode_prompts

    tok = AutoTokenizer.from_pretrained(cfg.model)
    return [len(ids) for ids in encode_prompts(tok, prompts)], f"{cfg.model}'s tokenizer"


# -- the plan ------------------------------------------------------------------------------------


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

    @classmethod
    def of(cls, res: SimResult, w: Workload, price: float | None, judge_tokens: float, replicas: int) -> StrategyPlan:
        attempts = res.attempts
        return cls(
            strategy=res.strategy, wall_s=res.wall_s, engine_s=res.engine_s / max(1, replicas),
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
        for p in s.phases:
            out[f"plan.phase.{p['name']}.wall_s"] = p["wall_s"]
        return out


def judge_prompt_tokens(spec: PipelineSpec, prompt: float, output: float) -> float:
    """Tokens of a judge prompt: the template's own text (~4 characters a token) plus the
    record's prompt and the result where it names them. A rule judge sends none."""
    if spec.judge.kind != "llm" or not spec.judge.template:
        return 0.0
    t = spec.judge.template
    literal = re.sub(r"\{[^{}]*\}", "", t)
    return len(literal) / 4 + (prompt if "{prompt}" in t else 0.0) + (output if "{result}" in t else 0.0)


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
    return EngineRates(infer_s=infer, judge_s=per_record(judge_prompt, w.judge_output_tokens, w.judge_output_tokens),
                       infer_latency_s=0.0, judge_latency_s=0.0, infer_tokens_out=w.output_tokens,
                       steps_per_record=1 / batch, calls_per_record=1 / batch, scheduling="blocking", profile="simulated-linear")


def local_overheads(spec: PipelineSpec) -> Overheads:
    """Latencies of the launcher the spec names: nothing to launch in process or locally."""
    if spec.pool.launcher == "k8s":
        return Overheads(retries=spec.pool.retries, checkpoint_interval_s=spec.pool.checkpoint_interval_s)
    return Overheads(task_s=0.05, driver_task_s=0.002, phase_launch_s=0.0, round_gap_s=0.0, list_page_s=0.01,
                     object_s=0.01, restart_s=10.0, retries=spec.pool.retries, checkpoint_interval_s=spec.pool.checkpoint_interval_s)


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
    overheads: Overheads | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
) -> RunPlan:
    """Plan ``spec`` for each of ``strategies`` (the spec's own is ``RunPlan.chosen``; keep it in them)."""
    notes: list[str] = []
    size = input_size(spec, sample=sample)
    n = records if records is not None else size.records
    notes.append(f"input: {n:,} records ({'given' if records is not None else size.how})")
    counts, how = prompt_token_counts(spec, size.sample)
    prompt_mean = sum(counts) / len(counts) if counts else (profile.prompt_tokens if profile and profile.prompt_tokens else 100.0)
    notes.append(f"prompt tokens: mean {prompt_mean:.1f} over {len(counts)} sample records ({how})")
    max_tokens = spec.infer.sampling.max_tokens
    sim_opts = spec.engine.simulated if spec.engine.kind == "simulated" else None
    if profile is not None and profile.output_tokens is not None:
        out_mean, out_how = profile.output_tokens, f"measured by the profile ({profile.source})"
    elif sim_opts is not None:
        out_mean, out_how = float(min(sim_opts.output_tokens, max_tokens)), "the simulated engine's output_tokens"
    else:
        out_mean, out_how = float(max_tokens), "max_tokens (an upper bound: run `batch-inference profile` to measure)"
    notes.append(f"output tokens: mean {out_mean:.1f} per inference ({out_how})")
    if approval is not None:
        a, a_how = approval, "given"
    elif profile is not None and profile.approval is not None:
        a, a_how = profile.approval, "measured by the profile"
    elif sim_opts is not None and spec.judge.kind == "llm":
        a, a_how = sim_opts.approval_rate, "the simulated judge's approval_rate"
    else:
        a, a_how = 0.5, "assumed (pass --approval or run `batch-inference profile`)"
    notes.append(f"approval per attempt: {a:.3f} ({a_how}), independent across attempts")
    judge_tokens = judge_prompt_tokens(spec, prompt_mean, out_mean)
    w = Workload(records=n, prompt_tokens=max(1.0, prompt_mean), output_tokens=max(1.0, out_mean), judge_prompt_tokens=judge_tokens,
                 output_lengths=(sim_opts.output_lengths if sim_opts is not None else "geometric"),
                 max_tokens=max_tokens, judge_output_tokens=spec.judge.max_tokens if spec.judge.kind == "llm" else 1,
                 approval=a)
    if profile is not None:
        rates = profile.rates()
        notes.append(f"engine: measured profile {profile.source}: {profile.infer_s * 1000:.3f} ms per inferred record, "
                     f"{profile.judge_s * 1000:.3f} ms per judged record, {profile.tail_attempt_s * 1000:.3f} ms per "
                     "in-place attempt (one replica at full load)")
    elif sim_opts is not None and sim_opts.cost_model == "linear" and gpu_profile is None:
        rates = linear_rates(spec, w)
        notes.append(f"engine: the simulated engine's linear cost ({sim_opts.latency_a_s}s + {sim_opts.latency_b_s}s/token per "
                     f"batch, the batcher's token budget): {rates.infer_s * 1000:.3f} ms per inferred record, "
                     f"{rates.judge_s * 1000:.3f} ms per judged record, engine time only (no pipeline overhead: profile for that)")
    else:
        name = gpu_profile or (sim_opts.profile if sim_opts is not None and sim_opts.cost_model == "decode" else DEFAULT_GPU_PROFILE)
        prof = get_profile(name)
        rates = engine_rates(prof, w, sample=min(20_000, max(2_000, n)))
        notes.append(f"engine: calibrated decode-step profile {name} ({prof.source}), continuous batching: "
                     f"{rates.infer_s * 1000:.3f} ms per inferred record, {rates.judge_s * 1000:.3f} ms per judged record per replica")
    replicas = gpus or spec.pool.replicas
    if spec.pool.launcher == "inprocess" and gpus is None:
        cluster = Cluster(replicas=1, concurrency=spec.pool.concurrency * spec.pool.replicas)
    else:
        cluster = Cluster(replicas=replicas, concurrency=spec.pool.concurrency)
    o = overheads or local_overheads(spec)
    if profile is not None and profile.overheads:
        o = dataclasses.replace(o, **profile.overheads)
    notes.append(f"cluster: {cluster.replicas} replica(s) x {cluster.concurrency} slots; overheads: task {o.task_s}s, "
                 f"phase launch {o.phase_launch_s}s, round gap {o.round_gap_s}s, recompaction {o.recompact_records_per_s:,.0f} rec/s, "
                 f"resharding {o.reshard_records_per_s:,.0f} rec/s")
    if gpu_hour_price is not None:
        notes.append(f"cost: GPU-hours (replicas x wall from the first phase) x {gpu_hour_price}/GPU-hour")
    plans = []
    for strategy in strategies:
        s = spec.model_copy(update={"strategy": strategy})
        res = simulate(s, w, rates, cluster=cluster, overheads=o)
        plans.append(StrategyPlan.of(res, w, gpu_hour_price, judge_tokens, cluster.replicas))
    return RunPlan(spec.run, n, cluster.replicas, cluster.concurrency, gpu_hour_price, plans, notes, spec.strategy)


# -- measuring a profile -------------------------------------------------------------------------


async def measure_profile(spec: PipelineSpec, *, records: int = 10_000, workdir: str | None = None) -> EngineProfile:
    """Run a sample of the spec's input through the real pipeline on this hardware and time it.

    Two short runs in a scratch output: the first ``records`` records by rounds (two
    rounds: reshard, infer, judge, recompact, infer, judge), and half of them in place
    (two attempts). Round 1 sees about ``1 - approval`` of round 0's records with the same
    shard size, so each phase's wall is fitted as ``fixed + per_record x records`` from
    the two rounds: per-record costs include everything on the task path (phase wall x
    workers / records), and the fixed part becomes the plan's per-phase overhead.
    """
    from batch_inference.pipeline.ledger import Ledger
    from batch_inference.pipeline.run import run_pipeline

    size = input_size(spec, sample=records)
    sample = size.sample[:records]
    if len(sample) < 4:
        raise ValueError(f"{spec.input}: {len(sample)} record(s) are too few to profile (need 4 or more)")
    own = workdir is None
    base = Path(workdir or tempfile.mkdtemp(prefix="bi-profile-"))
    base.mkdir(parents=True, exist_ok=True)
    half = sample[: len(sample) // 2]
    shard = max(1, min(spec.shard_records, len(sample) // 4))
    try:
        ledgers = {}
        walls = {}
        for name, strategy, recs in (("profile-rounds", "rounds", sample), ("profile-in-place", "in_place", half)):
            src = base / f"{name}.jsonl"
            src.write_text("".join(json.dumps(r) + "\n" for r in recs))
            s = spec.model_copy(update={
                "input": str(src), "output": str(base / "out"), "run": name, "strategy": strategy, "storage_options": {},
                "shard_records": shard, "chunk_size": min(spec.chunk_size, shard), "max_rounds": 2, "max_attempts": 2,
            })
            t0 = time.perf_counter()
            await run_pipeline(s)
            walls[name] = time.perf_counter() - t0
            ledgers[name] = Ledger(RunLayout(str(base / "out"), name))
        rl, tl = ledgers["profile-rounds"], ledgers["profile-in-place"]
        i0, i1 = (PhaseSummary.from_dict(rl.read(RunLayout.step_name(r, "infer")) or {}) for r in (0, 1))
        j0, j1 = (PhaseSummary.from_dict(rl.read(RunLayout.step_name(r, "judge")) or {}) for r in (0, 1))
        recompact = rl.read(RunLayout.step_name(1, "recompact"))
        shard_big, shard_small = rl.read(RunLayout.SHARD) or {}, tl.read(RunLayout.SHARD) or {}
        tail_data = tl.read(RunLayout.TAIL)
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
    workers = 1 if spec.pool.launcher == "inprocess" else max(1, i0.workers or spec.pool.replicas)
    infer_c, infer_f = _fit(i0, i1)
    judge_c, judge_f = _fit(j0, j1)
    approved = j0.counts.get("approved", 0)
    judged = approved + j0.counts.get("rejected", 0)
    a = approved / judged if judged else 0.0
    tail = PhaseSummary.from_dict(tail_data) if tail_data else None
    attempts = tail.records_in * expected_attempts(a, 2) if tail is not None else 0.0
    fixed = (infer_f + judge_f) / 2
    overheads: dict[str, float] = {"task_s": 0.0, "phase_launch_s": fixed}
    if recompact and recompact.get("wall_s") and recompact.get("records"):
        overheads["recompact_records_per_s"] = recompact["records"] / recompact["wall_s"]
    dn = shard_big.get("records", 0) - shard_small.get("records", 0)
    dw = shard_big.get("wall_s", 0.0) - shard_small.get("wall_s", 0.0)
    if dn > 0 and dw > 0:
        overheads["reshard_records_per_s"] = dn / dw
    elif shard_big.get("wall_s"):
        overheads["reshard_records_per_s"] = shard_big["records"] / shard_big["wall_s"]
    return EngineProfile(
        source=f"measured on {platform.node()} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {len(sample):,} records, "
               f"engine {spec.engine.kind}, pool {spec.pool.launcher} {spec.pool.replicas}x{spec.pool.concurrency}",
        infer_s=infer_c * workers,
        judge_s=judge_c * workers,
        tail_attempt_s=(max(0.0, tail.wall_s - fixed) * workers / attempts) if tail is not None and attempts else 0.0,
        output_tokens=i0.tokens_out / max(1, i0.records_in),
        approval=a,
        prompt_tokens=i0.tokens_in / max(1, i0.records_in),
        overheads=overheads,
        measured={"records": len(sample), "shard_records": shard, "rounds_wall_s": round(walls["profile-rounds"], 3),
                  "in_place_wall_s": round(walls["profile-in-place"], 3),
                  "infer_wall_s": [i0.wall_s, i1.wall_s], "infer_records": [i0.records_in, i1.records_in],
                  "judge_wall_s": [j0.wall_s, j1.wall_s], "infer_engine_s": i0.engine_busy_s, "judge_engine_s": j0.engine_busy_s,
                  "tail_wall_s": tail.wall_s if tail is not None else None, "workers": workers,
                  "loadavg": os.getloadavg()[0]},
    )


def _fit(big: PhaseSummary, small: PhaseSummary) -> tuple[float, float]:
    """(seconds per record, fixed seconds) of a phase from two sizes (one size: no fixed part)."""
    dn = big.records_in - small.records_in
    if dn > 0 and big.wall_s > small.wall_s:
        per = (big.wall_s - small.wall_s) / dn
        return per, max(0.0, big.wall_s - per * big.records_in)
    return big.wall_s / max(1, big.records_in), 0.0


def run_measure_profile(spec: PipelineSpec, **kw: Any) -> EngineProfile:
    return asyncio.run(measure_profile(spec, **kw))


__all__ = ["EngineProfile", "RunPlan", "StrategyPlan", "input_size", "make_plan", "measure_profile", "PROFILES"]


# -- ETA and planned vs actual while a run goes --------------------------------------------------


def eta_after_round(spec: PipelineSpec, r: int, infer: PhaseSummary, judge: PhaseSummary, decision_kind: str,
                    *, recompact_s: float = 0.0) -> float:
    """Seconds the run still needs after round ``r`` was decided, from this round's own
    measured throughput and the pending set (the scale simulation over what is left)."""
    rejected = judge.rejected
    if decision_kind in ("done", "exhausted") or rejected <= 0:
        return 0.0
    workers = max(1, infer.workers or spec.pool.replicas)
    per_infer = infer.wall_s * workers / max(1, infer.records_in)
    per_judge = judge.wall_s * workers / max(1, judge.records_in)
    judged = judge.approved + rejected
    a = judge.approved / judged if judged else 0.5
    rates = EngineRates(infer_s=per_infer, judge_s=per_judge, infer_latency_s=0.0, judge_latency_s=0.0,
                        infer_tokens_out=infer.tokens_out / max(1, infer.records_in), steps_per_record=0.0,
                        calls_per_record=0.0, scheduling="measured", profile=f"round {r}")
    left = spec.model_copy(update={
        "strategy": "in_place" if decision_kind == "tail" else spec.strategy,
        "max_rounds": max(1, spec.max_rounds - (r + 1)), "max_attempts": max(1, spec.max_attempts - (r + 1)),
    })
    w = Workload(records=rejected, approval=a)
    cluster = Cluster(replicas=workers, concurrency=spec.pool.concurrency * (spec.pool.replicas if workers == 1 else 1))
    o = dataclasses.replace(local_overheads(spec), task_s=0.0, phase_launch_s=0.0, reshard_records_per_s=float("inf"),
                            recompact_records_per_s=(rejected / recompact_s) if recompact_s > 0 else 110_000.0)
    return simulate(left, w, rates, cluster=cluster, overheads=o).wall_s


def planned_vs_actual(plan: dict[str, Any], phases: list[tuple[str, float]]) -> list[tuple[str, float | None, float | None]]:
    """(phase, planned wall s, actual wall s) for a recorded plan (``RunPlan.as_dict``) and measured phases."""
    chosen = next((s for s in plan.get("strategies", []) if s["strategy"] == plan.get("chosen")), None)
    planned = {p["name"]: float(p["wall_s"]) for p in (chosen or {}).get("phases", [])}
    actual = dict(phases)
    names = list(planned) + [n for n in actual if n not in planned]
    return [(n, planned.get(n), actual.get(n)) for n in names]


def measured_phases(ledger: Any) -> list[tuple[str, float]]:
    """(phase, wall s) of a run as its ledger recorded them, named as the plan names them."""
    out = []
    if (s := ledger.read(RunLayout.SHARD)) is not None:
        out.append(("shard (reshard input, CPU)", float(s["wall_s"])))
    r = 0
    while (inf := ledger.read(RunLayout.step_name(r, "infer"))) is not None:
        out.append((f"round {r} infer", float(inf["wall_s"])))
        if (j := ledger.read(RunLayout.step_name(r, "judge"))) is not None:
            out.append((f"round {r} judge", float(j["wall_s"])))
        if (rc := ledger.read(RunLayout.step_name(r + 1, "recompact"))) is not None:
            out.append((f"round {r} recompact", float(rc["wall_s"])))
        r += 1
    if (t := ledger.read(RunLayout.TAIL)) is not None:
        out.append(("tail", float(t["wall_s"])))
    return out
