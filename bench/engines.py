"""Engine benchmark: tiny-model throughput by batch size, and cold start vs a warm call.

    .venv/bin/python bench/engines.py [--repeats 3] [--tokens 16] [--out bench/reports/engines.md]

Runs the real tiny Llama through the transformers engine on this CPU (one torch
thread, as workers run). Throughput at batch 1, 8, 32, 128 with a fixed output length
(``min_tokens == max_tokens``) gives the cost curve; a least-squares fit of
``seconds = a + b x batch_tokens`` (prompt + output tokens) gives the simulated engine's
``latency_a_s`` / ``latency_b_s`` for this machine. Cold start is a fresh subprocess
(interpreter + imports + load + first call), set against one warm call in this process:
the gap is why workers are persistent. Figures on a shared 2-core machine are noisy;
compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batch_inference.engines import SamplingParams, build_engine, make_tiny_model  # noqa: E402

BATCHES = (1, 8, 32, 128)
PROMPT = "Question: what is the capital of France? Answer in one word, item {i}."

COLD = """
import json, sys, time
t0 = time.perf_counter()
from batch_inference.engines import SamplingParams, build_engine
import batch_inference.engines.transformers_engine  # torch + transformers
t1 = time.perf_counter()
engine = build_engine({{"kind": "transformers", "model": {model!r}, "device": "cpu"}})
t2 = time.perf_counter()
engine.generate(["hello world"], SamplingParams(max_tokens={n}, min_tokens={n}))
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "load_s": t2 - t1, "first_call_s": t3 - t2}}))
"""


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per prompt (fixed)")
    ap.add_argument("--out", default=str(ROOT / "bench/reports/engines.md"))
    args = ap.parse_args()

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-model-")) / "model")
    engine = build_engine({"kind": "transformers", "model": str(model), "device": "cpu", "num_threads": 1})
    params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens)
    engine.generate([PROMPT.format(i=0)] * 4, params)  # warm up kernels and allocator

    rows = []
    for n in BATCHES:
        prompts = [PROMPT.format(i=i) for i in range(n)]
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = engine.generate(prompts, params)
            times.append(time.perf_counter() - t)
        assert all(c.completion_tokens == args.tokens for c in out), "fixed output length expected"
        prompt_tokens = sum(c.prompt_tokens for c in out)
        wall = statistics.median(times)
        rows.append({"batch": n, "wall_s": wall, "batch_tokens": prompt_tokens + n * args.tokens,
                     "out_tok_s": n * args.tokens / wall, "all_tok_s": (prompt_tokens + n * args.tokens) / wall})
        print(f"batch {n:4d}: {wall * 1000:8.1f} ms  {rows[-1]['out_tok_s']:9.0f} output tok/s  {rows[-1]['all_tok_s']:9.0f} tok/s", flush=True)
    a, b = fit_line([r["batch_tokens"] for r in rows], [r["wall_s"] for r in rows])
    print(f"fit: seconds = {a:.4f} + {b:.2e} x batch_tokens  (simulated: latency_a_s={a:.4f}, latency_b_s={b:.2e})")

    t = time.perf_counter()
    engine.generate(["hello world"], params)
    warm_s = time.perf_counter() - t
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", COLD.format(model=str(model), n=args.tokens)],
                          capture_output=True, text=True, timeout=300, check=True, cwd=ROOT)
    cold_total = time.perf_counter() - t
    cold = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"cold start: {cold_total:.2f} s total (import {cold['import_s']:.2f} s, load {cold['load_s']:.2f} s, "
          f"first call {cold['first_call_s']:.3f} s) vs warm call {warm_s * 1000:.1f} ms = {cold_total / warm_s:.0f}x")

    lines = [
        "# Engine benchmark (tiny Llama, transformers engine, CPU, 1 torch thread)",
        "",
        f"Command: `.venv/bin/python bench/engines.py --repeats {args.repeats} --tokens {args.tokens}`; "
        f"median of {args.repeats}; fixed output length {args.tokens} tokens (min_tokens = max_tokens). "
        "Shared 2-core machine: absolute figures are noisy, ratios within one run are the point.",
        "",
        "| batch | wall ms | batch tokens | output tok/s | prompt+output tok/s |",
        "|---:|---:|---:|---:|---:|",
        *(f"| {r['batch']} | {r['wall_s'] * 1000:.1f} | {r['batch_tokens']} | {r['out_tok_s']:.0f} | {r['all_tok_s']:.0f} |" for r in rows),
        "",
        f"Cost-model fit (least squares): `seconds = {a:.4f} + {b:.2e} x batch_tokens` — use "
        f"`simulated: {{latency_a_s: {max(a, 0):.4f}, latency_b_s: {b:.2e}}}` to mimic this model on this CPU.",
        "",
        f"Cold start (fresh subprocess: interpreter + imports + load + first call): **{cold_total:.2f} s** "
        f"(imports {cold['import_s']:.2f} s, load {cold['load_s']:.2f} s, first call {cold['first_call_s']:.3f} s) "
        f"vs a warm call **{warm_s * 1000:.1f} ms** ({cold_total / warm_s:.0f}x): a worker that reloads per task "
        "spends its time starting, not generating — workers must be persistent.",
        "",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
