"""CPU time per request outside the engine core: the pipeline's vLLM path against ``LLM.generate`` (issue 41 item 1).

The same requests (token ids, exactly ``--output`` tokens each at temperature 0) go

- ``raw``: into one ``LLM.generate`` call, in a helper process of its own (one vLLM engine a
  process; ``_raw_vllm.RawProcess``);
- ``stream``: into the pipeline's engine path in this process: ``VllmStreamingEngine``
  (vLLM's ``AsyncLLM``) behind the worker's ``StreamGate`` (its bound, one task per request),
  every request submitted at once as a shard task does.

Each measurement reads the CPU seconds of every process (``engine_ceiling.CpuMeter``): the
front end (raw's helper, or this process: tokenised ids in, ``LLM.generate``'s / ``AsyncLLM``'s
input processing, the engine-core client, output processing, our engine and gate) against the
engine core's process. The front end's CPU seconds over the requests is the figure: µs a
request outside the engine core, per path, and their ratio. Shapes: ``short`` (~130-token
prompts, the engine's work is small) and ``long`` (~1,000-token prompts). The paths alternate
within each repeat, each after ``_raw_vllm.settle``; each engine's prefix cache is emptied first.

``--profile`` runs one more stream measurement per shape under cProfile (this process's event
loop thread: our engine, the gate and vLLM's output handler) and one raw measurement under
cProfile in the helper, and prints the top functions by own time into the report.

    env=$(bash .ci/vllm_cpu_env.sh)
    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 $env/bin/python bench/request_cost.py --repeats 3 --profile
    .venv/bin/python bench/request_cost.py      # re-runs itself in that venv

Writes bench/reports/request_cost.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _raw_vllm
from _raw_vllm import load, serve, settle
from engine_ceiling import CpuMeter

REPORTS = Path(__file__).resolve().parent / "reports"
VOCAB = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box near rivers "
         "mountains and old cities under pale sky bright cold warm river stone field house light").split()
SHAPES = {"short": 40, "long": 320}  # words per prompt (~3 tokens a word with the tiny model's tokenizer)


def prompts(shape: str, n: int, seed: int) -> list[str]:
    """``n`` distinct prompts of one shape (a number first: nothing shared between them)."""
    rng = random.Random(f"{shape}-{seed}")
    return [f"{rng.randrange(10**9)} " + " ".join(rng.choice(VOCAB) for _ in range(SHAPES[shape])) + "\nAnswer:"
            for _ in range(n)]


def engine_config(model: str, blocks: int) -> dict[str, Any]:
    return {"kind": "vllm", "model": model, "dtype": "float32", "max_model_len": 2048, "device": "cpu",
            "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "num_gpu_blocks_override": blocks}}}


def top_functions(profile: cProfile.Profile, n: int = 25) -> str:
    """The profile's top ``n`` functions by own time (pstats' table)."""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    text = out.getvalue()
    return text[text.find("   ncalls"):].rstrip()


# --------------------------------------------------------------------------- raw


def raw_server(model: str, blocks: int) -> None:
    """``LLM.generate`` in a process of its own, fed job lines of token ids."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from batch_inference.engines import EngineConfig
    from batch_inference.engines.vllm_engine import engine_kwargs

    llm = LLM(**engine_kwargs(EngineConfig.model_validate(engine_config(model, blocks))))

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        sampling = SamplingParams(max_tokens=job["output"], min_tokens=job["output"], temperature=0.0)
        llm.reset_prefix_cache()
        profile = cProfile.Profile() if job.get("profile") else None
        t0, cpu0 = time.perf_counter(), time.process_time()
        if profile:
            profile.enable()
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in job["ids"]], sampling_params=sampling, use_tqdm=False)
        if profile:
            profile.disable()
        return {"seconds": time.perf_counter() - t0, "process_cpu_s": time.process_time() - cpu0,
                "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "profile": top_functions(profile) if profile else None}

    serve(handle)


# --------------------------------------------------------------------------- the pipeline's engine path


async def run_stream(gate: Any, ids: list[list[int]], output: int, profile: cProfile.Profile | None) -> dict[str, Any]:
    """Every request through the gate at once (a shard task's ``submit_many``), all awaited."""
    from batch_inference.engines import SamplingParams, Tokens
    from batch_inference.pool.request import GenRequest

    params = SamplingParams(max_tokens=output, min_tokens=output, temperature=0.0)
    requests = [GenRequest(Tokens(x, ""), params, len(x)) for x in ids]
    await gate.engine.reset_prefix_cache()
    t0, cpu0 = time.perf_counter(), time.process_time()
    if profile:
        profile.enable()
    futures = await gate.submit_many(requests)
    done = await asyncio.gather(*futures)
    if profile:
        profile.disable()
    assert all(c.error is None for c in done), [c.error for c in done if c.error][:3]
    return {"seconds": time.perf_counter() - t0, "process_cpu_s": time.process_time() - cpu0,
            "tokens": sum(c.completion_tokens for c in done)}


async def measure(args: argparse.Namespace, model: str, root: Path) -> list[dict[str, Any]]:
    from batch_inference.engines import EngineConfig
    from batch_inference.engines.vllm_engine import VllmStreamingEngine
    from batch_inference.pool.streaming import StreamGate

    raw = await asyncio.to_thread(_raw_vllm.RawProcess, __file__, ["--model", model, "--blocks", str(args.blocks)])
    engine = await asyncio.to_thread(VllmStreamingEngine, EngineConfig.model_validate(engine_config(model, args.blocks)))
    await engine.start()
    gate = StreamGate(engine, engine.capacity())
    tokenizer = engine.tokenizer
    rows: list[dict[str, Any]] = []
    try:
        shapes = args.shapes.split(",")
        counts = {"short": args.records, "long": max(1, args.records // 4)}
        for shape in shapes:  # warm both engines on this shape (first-request costs are not per-request costs)
            warm = [tokenizer.encode(p) for p in prompts(shape, 32, -1)]
            await run_stream(gate, warm, args.output, None)
            await asyncio.to_thread(raw.request, {"ids": warm, "output": args.output})
        for rep in range(args.repeats):
            for shape in shapes:
                ids = [tokenizer.encode(p) for p in prompts(shape, counts[shape], rep)]
                row: dict[str, Any] = {"shape": shape, "repeat": rep, "requests": len(ids),
                                       "prompt_tokens": sum(map(len, ids)) / len(ids)}
                for path in (["raw", "stream"] if rep % 2 == 0 else ["stream", "raw"]):
                    await asyncio.to_thread(settle)
                    before, meter = load(), CpuMeter()
                    if path == "raw":
                        out = await asyncio.to_thread(raw.request, {"ids": ids, "output": args.output})
                    else:
                        out = await run_stream(gate, ids, args.output, None)
                    cpu = meter.stop()
                    front = cpu.get("raw frontend" if path == "raw" else "driver", 0.0)
                    row[path] = {**out, "cpu_s": cpu, "load": (before, load()), "front_s": front,
                                 "front_us": 1e6 * out["process_cpu_s"] / len(ids), "core_s": cpu.get("engine core", 0.0)}
                    print(f"{shape} rep {rep} {path}: {out['seconds']:.2f} s, front {row[path]['front_us']:.0f} us/request, cpu {cpu}",
                          file=sys.stderr, flush=True)
                row["ratio"] = row["stream"]["front_us"] / row["raw"]["front_us"]
                row["wall_ratio"] = row["stream"]["seconds"] / row["raw"]["seconds"]
                rows.append(row)
        if args.profile:
            for shape in shapes:
                ids = [tokenizer.encode(p) for p in prompts(shape, counts[shape], 99)]
                profile = cProfile.Profile()
                await asyncio.to_thread(settle)
                await run_stream(gate, ids, args.output, profile)
                raw_out = await asyncio.to_thread(raw.request, {"ids": ids, "output": args.output, "profile": True})
                rows.append({"shape": shape, "profile": {"stream": top_functions(profile), "raw": raw_out["profile"]}})
    finally:
        await gate.stop()
        await engine.aclose()
        await asyncio.to_thread(raw.close)
    return rows


def report(args: argparse.Namespace, rows: list[dict[str, Any]], wall: float, before: float, after: float) -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=_raw_vllm.REPO).stdout.strip()
    measured = [r for r in rows if "profile" not in r]
    lines = ["# CPU time per request outside the engine core: the pipeline's vLLM path against `LLM.generate`", "",
             f"`bench/request_cost.py {' '.join(sys.argv[1:])}` (at `{head}`) on {platform.node()} ({os.cpu_count()} CPUs, shared "
             f"with other sessions), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {wall:.0f} s in all; 1-min load "
             f"average {before} before, {after} after. vLLM-CPU 0.32, the tiny model, KV cache {args.blocks} blocks. Every "
             f"request decodes exactly {args.output} tokens at temperature 0; distinct prompts (nothing shared).", "",
             "raw = one `LLM.generate` of the token ids in a helper process; stream = the pipeline's engine path "
             "(`VllmStreamingEngine` behind the `StreamGate`, every request submitted at once). front µs/request = the "
             "front-end process's CPU time (`time.process_time`: every thread of it) over the requests; engine core = the "
             "engine-core process's CPU seconds (`CpuMeter`).", "",
             "| shape | repeat | requests | prompt tokens | raw wall s | stream wall s | raw front µs/req | stream front µs/req | "
             "stream / raw (front) | stream / raw (wall) | raw core s | stream core s | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in measured:
        a, b = r["raw"], r["stream"]
        lines.append(f"| {r['shape']} | {r['repeat']} | {r['requests']} | {r['prompt_tokens']:.0f} | {a['seconds']:.2f} | "
                     f"{b['seconds']:.2f} | {a['front_us']:.0f} | {b['front_us']:.0f} | {r['ratio']:.2f} | {r['wall_ratio']:.2f} | "
                     f"{a['core_s']:.2f} | {b['core_s']:.2f} | {min(a['load'][0], b['load'][0])}..{max(a['load'][1], b['load'][1])} |")
    lines += ["", "Median per shape:", "", "| shape | raw front µs/req | stream front µs/req | stream / raw (front) | stream / raw (wall) |",
              "|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in measured):
        rs = [r for r in measured if r["shape"] == shape]
        lines.append(f"| {shape} | {statistics.median(r['raw']['front_us'] for r in rs):.0f} | "
                     f"{statistics.median(r['stream']['front_us'] for r in rs):.0f} | "
                     f"**{statistics.median(r['ratio'] for r in rs):.2f}** | {statistics.median(r['wall_ratio'] for r in rs):.2f} |")
    for r in rows:
        if "profile" in r:
            lines += ["", f"## cProfile, {r['shape']}: stream (this process's event-loop thread)", "", "```",
                      r["profile"]["stream"], "```", "", f"## cProfile, {r['shape']}: raw `LLM.generate` (the helper)", "", "```",
                      r["profile"]["raw"], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1000, help="short requests per measurement (long: a quarter)")
    ap.add_argument("--shapes", default="short,long")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=int, default=2, help="output tokens per request")
    ap.add_argument("--blocks", type=int, default=400, help="KV cache blocks (num_gpu_blocks_override)")
    ap.add_argument("--profile", action="store_true", help="one more measurement per shape under cProfile")
    ap.add_argument("--model", help="model directory (default: the tiny model, built here)")
    ap.add_argument("--report", help="report path (default bench/reports/request_cost.md)")
    ap.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_server:
        return raw_server(args.model, args.blocks)
    _raw_vllm.run_shape_bench(__file__, args, "request-cost-", measure, report, REPORTS / "request_cost.md")


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
