"""The pipeline at GPU speed (issue 41 #3): can one worker feed one simulated H200?

The simulated continuous engine (``cost_model: decode``, ``scheduling: continuous``) steps a
calibrated decode-step profile in **real time** on the worker's event loop, so whatever the
pipeline costs per request on that loop (or anywhere that delays the next request) shows as a
step started late: modelled GPU time lost (``engines.simulated._MAX_LAG_S``). For each profile
(``h200-llama-8b``; ``h200-llama-1b``, derived in ``engines/profiles.py``) and shape:

- **alone**: the engine model driven directly with the same requests, kept full by admission
  control (at most ``capacity()`` in flight, each replaced when it finishes), in this process;
- **pipeline**: ``run_pipeline`` on a local pool of one worker (infer only, one round): output
  tokens/s over the infer phase (the ledger's wall and tokens), and over the whole run
  (preflight, shard step, the pool's start, finalize);
- **ideal**: the same requests through the same scheduler in virtual time (no Python, no lag).

Prompts are distinct; outputs depend on the prompt alone (``greedy: prompt``), so both sides
generate the same tokens (checked). ``--sweep`` adds 1-output-token requests with shorter and
shorter prompts on the 1B profile: the engine's request rate rises until one worker's front end
(its event loop: task handling, rendering, the engine's own ``complete``) cannot keep up.

    .venv/bin/python bench/gpu_speed.py            # short + long on both profiles, and the sweep
    .venv/bin/python bench/gpu_speed.py --scale 0.25 --only short   # a quick look

Writes bench/reports/gpu_speed.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch_inference.engines.base import SamplingParams  # noqa: E402
from batch_inference.engines.config import SimulatedOptions  # noqa: E402
from batch_inference.engines.decode_model import run_continuous  # noqa: E402
from batch_inference.engines.simulated import DecodeStreamingEngine, simulated_completion  # noqa: E402
from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout, run_pipeline  # noqa: E402
from batch_inference.pipeline.runner import open_runner  # noqa: E402
from batch_inference.pool.launchers.local import LocalLauncher  # noqa: E402

REPORT = Path(__file__).resolve().parent / "reports" / "gpu_speed.md"
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Shape:
    name: str
    profile: str
    records: int
    prompt_tokens: tuple[int, int]  # uniform, inclusive
    output_mean: int
    max_tokens: int
    lengths: str = "geometric"

    def options(self) -> dict[str, Any]:
        return {"cost_model": "decode", "scheduling": "continuous", "profile": self.profile, "greedy": "prompt",
                "output_tokens": self.output_mean, "output_lengths": self.lengths}


def shapes(k: float, sweep: bool) -> list[Shape]:
    out = [
        # short: classification / extraction, prompts 100-700 tokens, 1-16 output tokens
        Shape("short", "h200-llama-8b", int(6_000 * k), (100, 700), 6, 16),
        Shape("short", "h200-llama-1b", int(20_000 * k), (100, 700), 6, 16),
        # long: ~1,000-2,000-token prompts, outputs geometric mean 128 capped at 256
        Shape("long", "h200-llama-8b", int(2_000 * k), (1_000, 2_000), 128, 256),
        Shape("long", "h200-llama-1b", int(6_000 * k), (1_000, 2_000), 128, 256),
    ]
    if sweep:  # one output token: the engine's request rate set by the prompt's length
        out += [Shape(f"sweep {p} tok", "h200-llama-1b", int(n * k), (p, p), 1, 1, "fixed")
                for p, n in ((200, 20_000), (100, 30_000), (50, 40_000), (25, 40_000))]
    return out


def prompts_for(shape: Shape, salt: int = 0) -> list[str]:
    """Distinct prompts of the shape's token lengths (the simulated tokenizer: 4 characters a token)."""
    rng = random.Random(f"{shape.name}/{shape.profile}/{salt}")
    body = "the customer writes about an order that arrived late and asks for a refund of the shipping " * 200
    out = []
    for i in range(shape.records):
        head = f"r{i} {rng.random():.6f}: "
        n = rng.randint(*shape.prompt_tokens) * 4
        out.append(head + body[: max(0, n - len(head))])
    return out


def params_for(shape: Shape) -> SamplingParams:
    return SamplingParams(max_tokens=shape.max_tokens, temperature=0.0)


def ideal(shape: Shape, prompts: list[str]) -> dict[str, float]:
    """The same requests through the same scheduler in virtual time: no Python, no lag."""
    opts = SimulatedOptions(**shape.options())
    p = params_for(shape)
    reqs = []
    for text in prompts:
        c = simulated_completion(text, p, opts, seed=0, max_model_len=MAX_MODEL_LEN)
        reqs.append((c.prompt_tokens, max(1, c.completion_tokens)))
    eng = DecodeStreamingEngine(opts, max_model_len=MAX_MODEL_LEN)
    res = run_continuous(eng.profile, reqs, max_in_flight=eng.capacity())
    return {"tok_s": res.output_tokens / res.seconds, "req_s": len(reqs) / res.seconds, "tokens": res.output_tokens,
            "seconds": res.seconds}


async def alone(shape: Shape, prompts: list[str]) -> dict[str, float]:
    """The engine model driven directly, kept full: at most ``capacity()`` requests in flight."""
    eng = DecodeStreamingEngine(SimulatedOptions(**shape.options()), max_model_len=MAX_MODEL_LEN)
    await eng.start()
    p = params_for(shape)
    slots = asyncio.Semaphore(eng.capacity())
    tokens = 0

    async def one(text: str) -> None:
        nonlocal tokens
        try:
            done = await eng.complete(text, p)
            tokens += done.completion_tokens  # after the await: ``tokens +=`` across it would lose updates
        finally:
            slots.release()

    loop = asyncio.get_running_loop()
    me = psutil.Process()
    cpu0 = cpu_s(me)
    t0 = loop.time()
    tasks = []
    for text in prompts:
        await slots.acquire()
        tasks.append(asyncio.create_task(one(text)))
    await asyncio.gather(*tasks)
    wall = loop.time() - t0
    cpu_us = 1e6 * (cpu_s(me) - cpu0) / len(prompts)
    modelled = eng.busy_s
    await eng.aclose()
    return {"tok_s": tokens / wall, "req_s": len(prompts) / wall, "tokens": tokens, "wall_s": wall, "busy_s": modelled, "cpu_us": cpu_us}


async def pipeline(shape: Shape, prompts: list[str], base: Path, tag: str, shards: int, result_cache: bool = False) -> dict[str, float]:
    src = base / f"{tag}.jsonl"
    with open(src, "wb") as f:
        f.write(b"".join(orjson.dumps({"id": f"r{i}", "prompt": t}) + b"\n" for i, t in enumerate(prompts)))
    run = f"gpu-speed-{tag}"
    spec = PipelineSpec.parse({
        # the result cache off unless asked (a user's default: on, every request a miss and a write here)
        "cache": {"enabled": result_cache}, "run": run, "input": str(src), "output": str(base / "out"),
        "engine": {"kind": "simulated", "max_model_len": MAX_MODEL_LEN, "simulated": shape.options()},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": shape.max_tokens, "temperature": 0.0}},
        "strategy": "rounds", "max_rounds": 1, "layout": {"prefix": False},
        # ``shards`` shard tasks, 10 at a time on the worker (its default concurrency), as a long
        # run keeps them: one task alone waits for each chunk's last request (a barrier per chunk)
        "shard_records": max(1, -(-shape.records // shards)),
        "pool": {"launcher": "local", "replicas": 1, "retries": 0, "name": run, "idle_ttl_s": None},
    })
    me = psutil.Process()
    try:
        async with open_runner(spec) as runner:  # the worker started first: its CPU over the run alone is counted
            workers0, driver0 = children_cpu_s(me), cpu_s(me)
            t0 = time.perf_counter()
            summary = await run_pipeline(spec, runner=runner)
            wall = time.perf_counter() - t0
            workers1, driver1 = children_cpu_s(me), cpu_s(me)
    finally:
        await asyncio.to_thread(LocalLauncher(None, name=run).down)
    assert summary.conservation.ok and summary.approved == shape.records, summary
    infer = Ledger(RunLayout(spec.output, spec.run)).view().rounds[0].infer
    assert infer is not None
    return {"tok_s": infer.tokens_out / infer.wall_s, "req_s": shape.records / infer.wall_s, "tokens": infer.tokens_out,
            "infer_s": infer.wall_s, "busy_s": infer.engine_busy_s, "run_wall_s": wall, "run_tok_s": infer.tokens_out / wall,
            "worker_cpu_us": 1e6 * (workers1 - workers0) / shape.records, "driver_cpu_us": 1e6 * (driver1 - driver0) / shape.records}


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def children_cpu_s(p: psutil.Process) -> float:
    """CPU seconds of this process's live children (the local pool's worker)."""
    total = 0.0
    for c in p.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += cpu_s(c)
    return total


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    base = Path(tempfile.mkdtemp(prefix="bi-gpu-speed-"))
    try:
        for k, shape in enumerate(shapes(args.scale, not args.no_sweep)):
            if args.only and not shape.name.startswith(args.only):
                continue
            prompts = prompts_for(shape)
            ide = ideal(shape, prompts)
            load0 = os.getloadavg()[0]
            a = await alone(shape, prompts)
            pipe = await pipeline(shape, prompts, base, f"{k}", args.shards, args.result_cache)
            assert a["tokens"] == pipe["tokens"] == ide["tokens"], (a["tokens"], pipe["tokens"], ide["tokens"])
            row = {"shape": shape.name, "profile": shape.profile, "records": shape.records,
                   "prompt_tokens": list(shape.prompt_tokens), "output_mean": shape.output_mean, "max_tokens": shape.max_tokens,
                   "ideal": ide, "alone": a, "pipeline": pipe, "ratio": pipe["tok_s"] / a["tok_s"],
                   "ratio_ideal": pipe["tok_s"] / ide["tok_s"], "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def render(rows: list[dict[str, Any]], args: argparse.Namespace, took: float) -> str:
    lines = [
        "# The pipeline at GPU speed: one worker against a simulated H200",
        "",
        f"`python bench/gpu_speed.py{f' --scale {args.scale}' if args.scale != 1 else ''}{f' --only {args.only}' if args.only else ''}{' --no-sweep' if args.no_sweep else ''}{f' --shards {args.shards}' if args.shards != 20 else ''}{' --result-cache' if getattr(args, 'result_cache', False) else ''}` on "
        f"{platform.node()} ({os.cpu_count()} CPUs, shared), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; took {took:.0f} s. "
        "Real time: the simulated continuous engine sleeps each modelled step on the worker's event loop, so every "
        "figure depends on this machine's load (1-min load average per row).",
        "",
        "Output tok/s. *alone*: the engine model driven directly in one process, kept full (at most `capacity()` = "
        "2 x max_num_seqs in flight). *pipeline*: `run_pipeline`, a local pool of one worker "
        f"(the records in {args.shards} shards, 10 tasks at a time), its infer phase "
        "(the ledger's tokens and wall); *whole run*: the same tokens over the whole `run_pipeline` (preflight, "
        "shard step, the worker's start, finalize). *ideal*: the same requests in virtual time (no Python at all). "
        "Output tokens are the same on every side (outputs depend on the prompt alone).",
        "",
        "| shape | profile | records | prompt tok | output mean / max | ideal tok/s | alone tok/s | pipeline tok/s | **pipeline / alone** | pipeline / ideal | whole run tok/s | pipeline req/s | load before / after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["prompt_tokens"]
        lines.append(
            f"| {r['shape']} | {r['profile']} | {r['records']:,} | {p[0]}-{p[1]} | {r['output_mean']} / {r['max_tokens']} | "
            f"{r['ideal']['tok_s']:,.0f} | {r['alone']['tok_s']:,.0f} | {r['pipeline']['tok_s']:,.0f} | **{r['ratio']:.3f}** | "
            f"{r['ratio_ideal']:.3f} | {r['pipeline']['run_tok_s']:,.0f} | {r['pipeline']['req_s']:,.0f} | {r['load'][0]} / {r['load'][1]} |")
    lines += ["", "Requests/s (ideal / alone / pipeline), and CPU µs a request: the engine model alone (its process: "
              "answers, scheduler, step loop), the pipeline's worker (the same engine model + the worker's task path: "
              "reading, rendering, the StreamGate, writing) and the driver. CPU time is what the load does not change "
              "much: one core at 100% feeds 1e6 / (worker µs a request) requests/s.", "",
              "| shape | profile | ideal req/s | alone req/s | pipeline req/s | alone CPU µs/req | worker CPU µs/req | "
              "worker - alone µs/req | driver CPU µs/req | one worker core feeds req/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, p = r["alone"], r["pipeline"]
        if "cpu_us" not in a:
            continue
        lines.append(f"| {r['shape']} | {r['profile']} | {r['ideal']['req_s']:,.0f} | {a['req_s']:,.0f} | {p['req_s']:,.0f} | "
                     f"{a['cpu_us']:.0f} | {p['worker_cpu_us']:.0f} | {p['worker_cpu_us'] - a['cpu_us']:.0f} | "
                     f"{p['driver_cpu_us']:.0f} | {1e6 / p['worker_cpu_us']:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="records x this (0.25: a quick look)")
    ap.add_argument("--only", default=None, help="shapes whose name starts with this (short, long, sweep)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--shards", type=int, default=20, help="shard tasks a run's records are cut into (10 run at once)")
    ap.add_argument("--result-cache", action="store_true",
                    help="the pipeline with the cross-run result cache on (the spec default; fresh, so every request a miss and a write)")
    ap.add_argument("--report", type=Path, default=REPORT)
    ap.add_argument("--render", action="store_true", help="rebuild the report from its .json (no measurement)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.render:
        rows = json.loads(args.report.with_suffix(".json").read_text())
    else:
        rows = asyncio.run(measure(args))
    text = render(rows, args, time.perf_counter() - t0)
    args.report.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    args.report.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
