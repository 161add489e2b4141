"""The planner against a real run on this machine (issue 16's figure: within 15%).

1. Write N records; 2. ``batch-inference profile`` on a sample (the real pipeline on
this hardware); 3. ``batch-inference plan`` with that profile; 4. the real run of the
same spec (``run_pipeline``, in-process pool, simulated engine); 5. predicted vs measured
wall, per phase and in total. The machine is shared: the load (load average and the CPU
share other processes took, from /proc/stat and our own rusage) is measured during the
profile and during the run, and reported next to the figures.

    python bench/plan_vs_actual.py                      # 200k records, rounds, approval 0.5
    python bench/plan_vs_actual.py --records 20000 --strategies rounds
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from batch_inference.pipeline import PipelineSpec
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.layout import RunLayout
from batch_inference.planning.plan import make_plan
from batch_inference.planning.profiling import measure_profile
from batch_inference.planning.progress import measured_phases
from batch_inference.pipeline.driver import run_pipeline

REPORT = Path(__file__).parent / "reports" / "plan_vs_actual.md"


def cpu_times() -> tuple[float, float]:
    """(machine busy CPU-seconds, this process's CPU-seconds) so far."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]
    busy = (sum(fields[:8]) - idle) / tick
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return busy, ru.ru_utime + ru.ru_stime


class Load:
    """The machine's load over a block: load average, and the CPU others took."""

    def __enter__(self) -> Load:
        self.t0 = time.perf_counter()
        self.c0 = cpu_times()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.t0
        busy, ours = (b - a for a, b in zip(self.c0, cpu_times()))
        cores = os.cpu_count() or 1
        self.others_cores = max(0.0, busy - ours) / wall
        self.ours_cores = ours / wall
        self.loadavg = os.getloadavg()[0]
        self.text = f"load avg {self.loadavg:.1f}; other processes used {self.others_cores:.2f} of {cores} cores, this one {self.ours_cores:.2f}"


def make_spec(input_path: str, output: str, run: str, strategy: str, approval: float) -> PipelineSpec:
    return PipelineSpec.parse({
        "run": run, "input": input_path, "output": output,
        "engine": {"kind": "simulated", "simulated": {"approval_rate": approval, "latency_a_s": 0.002, "latency_b_s": 1e-5,
                                                      "output_tokens": 16}},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 16, "seed": 1}},
        "judge": {"kind": "llm", "template": "{result}", "max_tokens": 1},
        "strategy": strategy, "max_rounds": 5, "max_attempts": 5, "shard_records": 5_000, "chunk_size": 1_000,
        "pool": {"concurrency": 10, "retries": 0},
    })


async def main_async(args: argparse.Namespace) -> list[str]:
    base = Path(tempfile.mkdtemp(prefix="bi-plan-"))
    try:
        src = base / "input.jsonl"
        with open(src, "wb") as f:
            for start in range(0, args.records, 10_000):
                f.write(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(start, min(args.records, start + 10_000))))
        lines = [
            "# Planner vs a real run on this machine",
            "",
            f"`python bench/plan_vs_actual.py --records {args.records} --profile-records {args.profile_records} "
            f"--strategies {','.join(args.strategies)} --approval {args.approval}` on {platform.node()} "
            f"({os.cpu_count()} CPUs, shared with other engineers' work), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "",
            "Spec: simulated engine (linear: 2 ms + 0.01 ms/token per batch, 16 output tokens, approval "
            f"{args.approval}), in-process pool of 10 slots, shards of 5,000, chunks of 1,000, 5 attempts. The profile "
            f"runs the real pipeline on the first {args.profile_records:,} records (two rounds, then in-place with two "
            "attempts) and the plan simulates the whole input from it; then the real run.",
            "",
            "*planned* comes from the profile taken just before the run (the planner's real use); *bracketed* "
            "averages the per-record costs of that profile and one taken just after the run, a check of how much of "
            "the gap is the machine's load changing between profile and run rather than the model.",
            "",
            "| strategy | planned wall s | measured wall s | measured / planned | bracketed plan s | measured / bracketed | load: profile before | load: run | load: profile after |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        details: list[str] = []
        for strategy in args.strategies:
            spec = make_spec(str(src), str(base / "out"), f"plan-{strategy}", strategy, args.approval)
            with Load() as load_profile:
                profile = await measure_profile(spec, records=args.profile_records)
            plan = await asyncio.to_thread(make_plan, spec, profile=profile, strategies=(strategy,))
            planned = plan.for_strategy(strategy)
            with Load() as load_run:
                t0 = time.perf_counter()
                await run_pipeline(spec)
                wall = time.perf_counter() - t0
            with Load() as load_after:
                after = await measure_profile(spec, records=args.profile_records)
            mean = dataclasses.replace(profile, **{k: (getattr(profile, k) + getattr(after, k)) / 2
                                                    for k in ("infer_s", "judge_s", "tail_attempt_s")},
                                       overheads={k: (v + after.overheads.get(k, v)) / 2 for k, v in profile.overheads.items()})
            bracketed = (await asyncio.to_thread(make_plan, spec, profile=mean, strategies=(strategy,))).for_strategy(strategy)
            lines.append(f"| {strategy} | {planned.wall_s:.1f} | {wall:.1f} | {wall / planned.wall_s:.2f} | {bracketed.wall_s:.1f} | "
                         f"{wall / bracketed.wall_s:.2f} | {load_profile.text} | {load_run.text} | {load_after.text} |")
            measured = dict(measured_phases(Ledger(RunLayout(spec.output, spec.run))))
            details += [f"### {strategy}", "", "| phase | planned s | measured s |", "|---|---|---|"]
            for p in planned.phases:
                m = measured.get(p["name"])
                details.append(f"| {p['name']} | {p['wall_s']:.2f} | {'' if m is None else f'{m:.2f}'} |")
            details += ["", "Assumptions: " + "; ".join(plan.assumptions), ""]
            shutil.rmtree(base / "out", ignore_errors=True)
        return lines + [""] + details
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--profile-records", type=int, default=10_000)
    ap.add_argument("--strategies", type=lambda s: s.split(","), default=["rounds", "hybrid"])
    ap.add_argument("--approval", type=float, default=0.5)
    ap.add_argument("--report", type=Path, default=REPORT)
    args = ap.parse_args()
    lines = asyncio.run(main_async(args))
    args.report.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
