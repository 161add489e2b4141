"""The planner against a real run on this machine (issue 16's figure: within 15%).

1. Write N records; 2. ``batch-inference profile`` on a sample (the real pipeline on
this hardware); 3. ``batch-inference plan`` with that profile; 4. the real run of the
same spec (``run_pipeline``, in-process pool, simulated engine); 5. predicted vs measured
wall, per phase and in total. The machine is shared: the load (load average and the CPU
share other processes took, from /proc/stat and our own rusage) is measured during the
profile and during the run, and reported next to the figures.

    python bench/plan_vs_actual.py                      # 200k records, rounds, approval 0.5
    python bench/plan_vs_actual.py --records 20000 --strategies rounds
    python bench/plan_vs_actual.py --shape tiny --records 4000 --profile-records 500 --strategies hybrid

``--shape tiny`` is a spec unlike the default one in every way the planner is tuned on:
the tiny transformers model (a real engine, built here offline) with sampled output, a
regex judge on the result, shards of 250, 4 attempts, a pool of 4 slots, and an input
sorted by prompt length (so its first records are not like the rest).
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

import orjson

from batch_inference.pipeline import PipelineSpec
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.layout import RunLayout
from batch_inference.planning.plan import make_plan
from batch_inference.planning.profiling import measure_profile
from batch_inference.planning.progress import measured_phases
from batch_inference.pipeline.driver import run_pipeline

REPORT = Path(__file__).parent / "reports" / "plan_vs_actual.md"
TINY_TEXT = ("Spec: the tiny transformers model (CPU, one thread, sampled at temperature 1.0, 24 output tokens), a "
             "regex judge on the result, in-process pool of 4 slots, shards of 250, chunks of 50, 3 rounds, 4 attempts; "
             "the input is sorted by prompt length (2 to 42 words).")


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


def make_tiny_spec(input_path: str, output: str, run: str, strategy: str, model: str) -> PipelineSpec:
    return PipelineSpec.parse({
        "cache": {"enabled": False},  # benches measure the engine: every run computes its requests (bench/result_cache.py measures the cache)
        "run": run, "input": input_path, "output": output,
        "engine": {"kind": "transformers", "model": model, "dtype": "float32", "device": "cpu"},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 24, "temperature": 1.0, "seed": 7}},
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "[aeiou]{2}"}},
        "strategy": strategy, "max_rounds": 3, "max_attempts": 4, "shard_records": 250, "chunk_size": 50,
        "pool": {"concurrency": 4, "retries": 0},
    })


def write_input(path: Path, records: int, shape: str) -> None:
    with open(path, "wb") as f:
        if shape == "tiny":  # sorted by length: short questions first, long documents last
            words = "the a model batch record engine shard token judge round".split()
            for i in range(records):
                n = 2 + (40 * i) // max(1, records)
                f.write(orjson.dumps({"prompt": " ".join(words[(i + k) % len(words)] for k in range(n)) + f" {i}?"}) + b"\n")
            return
        for start in range(0, records, 10_000):
            f.write(b"".join(orjson.dumps({"prompt": f"q{i}"}) + b"\n" for i in range(start, min(records, start + 10_000))))


def make_spec(input_path: str, output: str, run: str, strategy: str, approval: float) -> PipelineSpec:
    return PipelineSpec.parse({
        "cache": {"enabled": False},  # benches measure the engine: every run computes its requests (bench/result_cache.py measures the cache)
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
        write_input(src, args.records, args.shape)
        model = ""
        if args.shape == "tiny":
            from batch_inference.engines.tiny_model import make_tiny_model

            model = str(make_tiny_model(base / "model", seed=0))
        lines = [
            "# Planner vs a real run on this machine",
            "",
            f"`python bench/plan_vs_actual.py --shape {args.shape} --records {args.records} --profile-records {args.profile_records} "
            f"--strategies {','.join(args.strategies)} --approval {args.approval}` on {platform.node()} "
            f"({os.cpu_count()} CPUs, shared with other engineers' work), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "",
            (TINY_TEXT if args.shape == "tiny" else
             "Spec: simulated engine (linear: 2 ms + 0.01 ms/token per batch, 16 output tokens, approval "
             f"{args.approval}), in-process pool of 10 slots, shards of 5,000, chunks of 1,000, 5 attempts.")
            + f" The profile runs the real pipeline on {args.profile_records:,} records drawn across the input (two "
            "rounds, then in-place with two attempts) and the plan simulates the whole input from it; then the real run.",
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
            spec = (make_tiny_spec(str(src), str(base / "out"), f"plan-{strategy}", strategy, model) if args.shape == "tiny"
                    else make_spec(str(src), str(base / "out"), f"plan-{strategy}", strategy, args.approval))
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
    ap.add_argument("--shape", choices=("simulated", "tiny"), default="simulated", help="the spec: see the module docstring")
    ap.add_argument("--report", type=Path, default=REPORT)
    args = ap.parse_args()
    lines = asyncio.run(main_async(args))
    args.report.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
