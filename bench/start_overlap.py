"""The start of a run: the shard step beside the pool's start, against one after the other.

Before the first task a run does two things that do not depend on each other: the shard step
(reshard the input, the layout pass: the driver's CPU, the model's tokenizer) and the pool's
start (worker processes spawned, each loading the model). ``run_pipeline`` runs them side by
side (``shard_while_opening``); this bench measures that against the order it replaced, in
the same run:

- ``sequential``: preflight, ``shard()``, then ``open_runner`` and ``drive`` (the old order);
- ``overlapped``: ``run_pipeline`` (preflight, then the shard step while the pool opens).

Each measurement is a fresh run of the same spec on a **local pool of real workers** (the
tiny transformers model, built here offline) started for it and stopped after, so every one
pays a whole pool start. The input is prefix-heavy (documents x questions, interleaved), so
the layout pass has work to do. Reported: each run's wall, its shard step (the ledger's), its
infer and judge phases (the ledger's), and the wall outside them (preflight, shard step, pool
start, recompaction, finalize): the part this change can shorten. Repeats alternate the
order of the two modes; the figure is the median of the per-repeat ratios.

    .venv/bin/python bench/start_overlap.py                       # 4,000 records, 1 worker, 3 repeats
    .venv/bin/python bench/start_overlap.py --records 2000 --replicas 2 --report bench/reports/start_overlap_2workers.md

Writes bench/reports/start_overlap.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import orjson
from _raw_vllm import load, measure_in_tmp, write_report

from batch_inference.pipeline import Ledger, PipelineRun, PipelineSpec, RunLayout, run_pipeline
from batch_inference.pipeline.driver import drive
from batch_inference.pipeline.preflight import preflight
from batch_inference.pipeline.runner import open_runner
from batch_inference.pool.launchers.local import LocalLauncher

WORDS = "the model reads a shard of records and the judge approves some answers while the pool stays busy".split()


def write_input(path: Path, records: int, documents: int) -> None:
    """Documents x questions, interleaved: record i asks question i // documents of document
    i % documents, so no two neighbours share their ~1,200-character document."""
    docs = [" ".join(WORDS[(d * 7 + k) % len(WORDS)] + (str(d) if k % 11 == 0 else "") for k in range(200))
            for d in range(documents)]
    with open(path, "wb") as f:
        for i in range(records):
            d, q = i % documents, i // documents
            f.write(orjson.dumps({"id": f"r{i}", "prompt": f"{docs[d]}\n\nQuestion {q}: what does part {q} say?"}) + b"\n")


def make_spec(src: Path, out: Path, run: str, model: str, args: argparse.Namespace) -> PipelineSpec:
    return PipelineSpec.parse({
        "cache": {"enabled": False},  # every run computes its requests
        "run": run, "input": str(src), "output": str(out),
        "engine": {"kind": "transformers", "model": model, "dtype": "float32", "device": "cpu"},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 1, "temperature": 0.0}},
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "."}},
        "strategy": "rounds", "max_rounds": 1, "shard_records": args.shard_records, "chunk_size": 50,
        "pool": {"launcher": "local", "replicas": args.replicas, "concurrency": 4, "retries": 0,
                 "name": run, "idle_ttl_s": None},
    })


async def sequential(spec: PipelineSpec) -> None:
    """The order run_pipeline had before: the shard step, then the pool's start."""
    await asyncio.to_thread(preflight, spec)
    run = PipelineRun(spec)
    await run.shard()
    async with open_runner(spec) as runner:
        run.runner = runner
        await drive(run)


async def measure(mode: str, base: Path, src: Path, model: str, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    run = f"overlap-{mode}-{rep}"
    spec = make_spec(src, base / "out", run, model, args)
    t0 = time.perf_counter()
    try:
        if mode == "sequential":
            await sequential(spec)
        else:
            summary = await run_pipeline(spec)
            assert summary.conservation["ok"], summary.conservation
    finally:
        stopped = await asyncio.to_thread(LocalLauncher(None, name=run).down)
    wall = time.perf_counter() - t0  # the pool's stop included on both sides, as it is outside the run
    view = Ledger(RunLayout(spec.output, spec.run)).view()
    infer, judge = view.rounds[0].infer, view.rounds[0].judge
    assert view.shard is not None and infer is not None and judge is not None
    assert view.shard.records == args.records and stopped == args.replicas
    return {"mode": mode, "repeat": rep, "wall_s": round(wall, 3), "shard_s": round(view.shard.wall_s, 3),
            "infer_s": round(infer.wall_s, 3), "judge_s": round(judge.wall_s, 3),
            "outside_s": round(wall - infer.wall_s - judge.wall_s, 3)}


def report(rows: list[dict[str, Any]], args: argparse.Namespace, loads: tuple[float, float]) -> str:
    by = {(r["mode"], r["repeat"]): r for r in rows}
    ratios = [by[("overlapped", k)]["outside_s"] / by[("sequential", k)]["outside_s"] for k in range(args.repeats)]
    saved = [by[("sequential", k)]["outside_s"] - by[("overlapped", k)]["outside_s"] for k in range(args.repeats)]
    shard = [r["shard_s"] for r in rows]
    lines = [
        "# The shard step beside the pool's start",
        "",
        f"`python bench/start_overlap.py --records {args.records} --documents {args.documents} --replicas {args.replicas} "
        f"--repeats {args.repeats}` on {platform.node()} ({os.cpu_count()} CPUs), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 1-min load average {loads[0]} before, {loads[1]} after.",
        "",
        f"Spec: the tiny transformers model on a local pool of {args.replicas} worker(s) started for each run (and "
        f"stopped after), 1 output token, a regex judge, one round; {args.records:,} records, {args.documents} documents "
        f"x questions interleaved, shards of {args.shard_records}, the layout pass on (the default). *sequential*: "
        "preflight, the shard step, then the pool's start and the run (the order before); *overlapped*: "
        "`run_pipeline` (the shard step while the pool starts). *outside* = wall - infer - judge phases: preflight, "
        "shard step, pool start and stop, finalize.",
        "",
        "| repeat | mode | wall s | shard step s | infer s | judge s | outside s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['repeat']} | {r['mode']} | {r['wall_s']:.2f} | {r['shard_s']:.2f} | {r['infer_s']:.2f} | "
              f"{r['judge_s']:.2f} | {r['outside_s']:.2f} |" for r in rows]
    lines += [
        "",
        f"**Outside the phases, overlapped / sequential: {statistics.median(ratios):.3f}x** (median of "
        f"{args.repeats}: {', '.join(f'{x:.3f}' for x in ratios)}); seconds saved a run: "
        f"{', '.join(f'{x:.2f}' for x in saved)}; the shard step took {min(shard):.2f}-{max(shard):.2f} s. "
        "What is saved is at most the shorter of the shard step and the pool's start; both use this machine's "
        "cores, so here they also compete for them (a GPU node's pool start is model loading onto the GPU, which "
        "the driver's CPU pass does not slow).",
    ]
    return "\n".join(lines) + "\n"


async def measure_all(args: argparse.Namespace, model: str, base: Path) -> list[dict[str, Any]]:
    """Every repeat, the two modes in alternating order, over one input."""
    src = base / "input.jsonl"
    write_input(src, args.records, args.documents)
    rows = []
    for rep in range(args.repeats):
        modes = ("sequential", "overlapped") if rep % 2 == 0 else ("overlapped", "sequential")
        for mode in modes:
            row = await measure(mode, base, src, model, args, rep)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return sorted(rows, key=lambda r: (r["repeat"], r["mode"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--documents", type=int, default=40)
    ap.add_argument("--shard-records", type=int, default=250)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", default="bench/reports/start_overlap.md")
    ap.add_argument("--model", default=None, help="a transformers model folder (default: the tiny model, built here)")
    args = ap.parse_args()
    before = load()
    rows = measure_in_tmp(args, "bi-overlap-", measure_all)
    write_report(Path(args.report), report(rows, args, (before, load())), rows)


if __name__ == "__main__":
    main()
