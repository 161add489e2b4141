"""The engine profile: per-record costs of one replica, measured on the target hardware.

``measure_profile`` (``batch-inference profile``) runs a sample of the spec's input through
the real pipeline twice (by rounds, then in place) and fits each phase's wall; the
profile file it writes is what ``planning.plan.make_plan`` prices a run with.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.spec import PipelineSpec, engine_label
from batch_inference.pipeline.summaries import PhaseSummary
from batch_inference.planning.rates import EngineRates
from batch_inference.planning.sizing import input_size
from batch_inference.storage import JsonlDir


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
    approval: float | None = None  # measured P(approved) on a record's first attempt
    retry_approval: float | None = None  # measured P(approved) on a later attempt of a rejected record
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


async def measure_profile(spec: PipelineSpec, *, records: int = 10_000, workdir: str | None = None) -> EngineProfile:
    """Run a sample of the spec's input through the real pipeline on this hardware and time it.

    Two short runs in a scratch output: ``records`` records drawn across the input by
    rounds (two rounds: reshard, infer, judge, recompact, infer, judge), and half of them
    in place (two attempts). Every run computes every request: the result cache is off
    (``cache.enabled: false``), so a profile neither reads an earlier run's answers (an
    attempt answered from the cache costs a file read, not engine work: it would price the
    engine at the cache's speed) nor fills the cache with its own. Shards are sized so that round 0 occupies every slot of the
    spec's pool (replicas x concurrency) in one wave of the largest shards the sample
    allows, as the run's own phases do: a profile run in fewer shards than slots
    under-fills the batcher and overprices every record. A short untimed run first pays
    the process's imports and warm-up, which a real run pays once, not per record.

    Round 1 sees about ``1 - approval`` of round 0's records with the same shard size, so
    each phase's wall is fitted as ``fixed + per_record x records`` from the two rounds:
    per-record costs include everything on the task path (phase wall x workers / records),
    and the fixed part becomes the plan's per-phase overhead. Approval is measured per
    attempt, first (round 0) and later (round 1, of records rejected once), and the
    in-place attempt's cost is divided by the attempts the tail's rows record, never by
    an attempt count that assumes independent attempts.
    """
    from batch_inference.pipeline.ledger import Ledger
    from batch_inference.pipeline.driver import run_pipeline

    size = input_size(spec, sample=records)
    sample = size.sample[:records]
    if len(sample) < 4:
        raise ValueError(f"{spec.input}: {len(sample)} record(s) are too few to profile (need 4 or more)")
    own = workdir is None
    base = Path(workdir or tempfile.mkdtemp(prefix="bi-profile-"))
    base.mkdir(parents=True, exist_ok=True)
    half = sample[::2]  # every other record: the sample is spread over the input, so is its half
    slots = max(1, spec.pool.replicas * spec.pool.concurrency)
    shard = max(1, min(spec.shard_records, len(sample) // slots))  # round 0: one wave over every slot
    computed = spec.cache.model_copy(update={"enabled": False})  # engine work only: never read nor fill the result cache
    try:
        ledgers = {}
        walls = {}
        # Imports, the model's load and the first calls' warm-up are paid once per run, not
        # per record: a short untimed run pays the process's share before anything is timed.
        warm = base / "profile-warm.jsonl"
        warm.write_text("".join(json.dumps(r) + "\n" for r in sample[:slots]))
        await run_pipeline(spec.model_copy(update={
            "input": str(warm), "output": str(base / "warm"), "run": "profile-warm", "strategy": "rounds", "storage_options": {}, "cache": computed,
            "shard_records": 1, "chunk_size": 1, "max_rounds": 1, "max_attempts": 1,
        }))
        for name, strategy, recs in (("profile-rounds", "rounds", sample), ("profile-in-place", "in_place", half)):
            src = base / f"{name}.jsonl"
            src.write_text("".join(json.dumps(r) + "\n" for r in recs))
            s = spec.model_copy(update={
                "input": str(src), "output": str(base / "out"), "run": name, "strategy": strategy, "storage_options": {}, "cache": computed,
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
        tail_rows = list(JsonlDir(RunLayout(str(base / "out"), "profile-in-place").tail_output).iter_records_sync())
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
    workers = 1 if spec.pool.launcher == "inprocess" else max(1, i0.workers or spec.pool.replicas)
    infer_c, infer_f = _fit(i0, i1, slots)
    judge_c, judge_f = _fit(j0, j1, slots)
    a, judged0 = _approval(j0)
    a_later, judged1 = _approval(j1)
    tail = PhaseSummary.from_dict(tail_data) if tail_data else None
    attempts = float(sum(int(row.get("attempts") or 1) for row in tail_rows))
    fixed = (infer_f + judge_f) / 2
    overheads: dict[str, float] = {"task_s": 0.0, "phase_launch_s": fixed}
    if recompact and recompact.get("wall_s") and recompact.get("records"):
        overheads["recompact_records_per_s"] = recompact["records"] / recompact["wall_s"]
    # Resharding a sample this small is mostly fixed cost: the faster of the two runs is the
    # closer figure for a whole input (a difference of two such walls is mostly noise).
    rates = [s["records"] / s["wall_s"] for s in (shard_big, shard_small) if s.get("records") and s.get("wall_s")]
    if rates:
        overheads["reshard_records_per_s"] = max(rates)
    return EngineProfile(
        source=f"measured on {platform.node()} ({_hardware()}) {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {len(sample):,} records, "
               f"engine {spec.engine.kind} model {engine_label(spec.engine)}, pool {spec.pool.launcher} {spec.pool.replicas}x{spec.pool.concurrency}",
        infer_s=infer_c * workers,
        judge_s=judge_c * workers,
        tail_attempt_s=(max(0.0, tail.wall_s - fixed) * workers / attempts) if tail is not None and attempts else 0.0,
        output_tokens=i0.tokens_out / max(1, i0.records_in),
        approval=a,
        retry_approval=a_later if judged1 else None,
        prompt_tokens=i0.tokens_in / max(1, i0.records_in),
        overheads=overheads,
        measured={"records": len(sample), "sampled": size.sampled, "shard_records": shard, "slots": slots,
                  "judged": [judged0, judged1], "tail_attempts": attempts, "rounds_wall_s": round(walls["profile-rounds"], 3),
                  "in_place_wall_s": round(walls["profile-in-place"], 3),
                  "infer_wall_s": [i0.wall_s, i1.wall_s], "infer_records": [i0.records_in, i1.records_in],
                  "judge_wall_s": [j0.wall_s, j1.wall_s], "infer_engine_s": i0.engine_busy_s, "judge_engine_s": j0.engine_busy_s,
                  "tail_wall_s": tail.wall_s if tail is not None else None, "workers": workers,
                  "loadavg": os.getloadavg()[0]},
    )


def _hardware() -> str:
    """This machine's accelerator as a plan names it: its GPUs, else its CPU cores."""
    try:
        import torch

        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            return ", ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names))
    except Exception:  # no torch, or no driver: the CPU is what ran it
        pass
    return f"CPU, {os.cpu_count()} cores"


def _approval(judge: PhaseSummary) -> tuple[float, int]:
    """(approved share, records judged) of a judge phase."""
    judged = judge.approved + judge.rejected
    return (judge.approved / judged if judged else 0.0), judged


def _fit(big: PhaseSummary, small: PhaseSummary, slots: int) -> tuple[float, float]:
    """(seconds per record, fixed seconds) of a phase from two sizes.

    Only sizes that both fill the pool's slots fit a line: a phase in fewer shards than
    slots runs its engine part-empty, so its wall says how full the batch was, not what a
    record costs. Otherwise the larger phase alone prices a record (no fixed part).
    """
    dn = big.records_in - small.records_in
    if dn > 0 and big.wall_s > small.wall_s and min(big.shards, small.shards) >= slots:
        per = (big.wall_s - small.wall_s) / dn
        return per, max(0.0, big.wall_s - per * big.records_in)
    return big.wall_s / max(1, big.records_in), 0.0


def run_measure_profile(spec: PipelineSpec, **kw: Any) -> EngineProfile:
    return asyncio.run(measure_profile(spec, **kw))
