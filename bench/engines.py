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

    .venv/bin/python bench/engines.py --batching [--prompts 200] [--mean-tokens 32] [--repeats 2]

compares the engine's batching options (``transformers: {batching: static | bucketed |
continuous}``) side by side instead: the same greedy prompts, per-record output lengths
(``max_tokens = min_tokens = n``, fixed and geometric), fed in token-budget batches as the
worker's batcher does; output tokens/s per option, its ratio to the best, and a check that
every option returned identical completions. Writes bench/reports/transformers_batching.md.
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


BATCHINGS = ("static", "bucketed", "continuous")


def compare_batching(args: argparse.Namespace) -> None:
    """The batching options, interleaved per repeat so load drifts hit all alike."""
    import os

    sys.path.insert(0, str(ROOT / "bench"))
    from engine_ceiling import lengths, prompts

    from batch_inference.pool.engine_host import BatcherOptions

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-model-")) / "model")
    engines = {b: build_engine({"kind": "transformers", "model": str(model), "device": "cpu", "num_threads": 1,
                                "transformers": {"batching": b}}) for b in BATCHINGS}
    texts = prompts(args.prompts)
    budget = BatcherOptions().target_batch_tokens
    counts = engines["static"].count_tokens(texts)
    for e in engines.values():
        e.generate(texts[:4], SamplingParams(max_tokens=4, min_tokens=4))  # warm up
    rows = []
    for dist in ("fixed", "geometric"):
        for rep in range(args.repeats):
            lens = lengths(dist, args.prompts, args.mean_tokens, args.mean_tokens * 4, seed=rep)
            params = [SamplingParams(max_tokens=n, min_tokens=n) for n in lens]
            batches, batch, cost = [], [], 0
            for i in range(len(texts)):  # the batcher's rule: close a batch once its cost reaches the budget
                batch.append(i)
                cost += counts[i] + lens[i]
                if cost >= budget or i == len(texts) - 1:
                    batches.append(batch)
                    batch, cost = [], 0
            row: dict = {"dist": dist, "repeat": rep, "p50": int(statistics.median(lens)), "max": max(lens),
                         "batches": len(batches), "load": round(os.getloadavg()[0], 1)}
            outs = {}
            for b, engine in engines.items():
                t = time.perf_counter()
                outs[b] = [c for bt in batches for c in engine.generate([texts[j] for j in bt], [params[j] for j in bt])]
                wall = time.perf_counter() - t
                row[b] = sum(c.completion_tokens for c in outs[b]) / wall
            row["identical"] = all(outs[b] == outs["static"] for b in BATCHINGS)
            best = max(row[b] for b in BATCHINGS)
            print(f"{dist:9s} rep {rep}: " + "  ".join(f"{b} {row[b]:7.0f} tok/s ({row[b] / best:.2f})" for b in BATCHINGS)
                  + f"  identical={row['identical']} load={row['load']}", flush=True)
            rows.append(row)
    lines = [
        "# Transformers engine batching options (tiny Llama, CPU float32, 1 torch thread)", "",
        f"Command: `.venv/bin/python bench/engines.py --batching --prompts {args.prompts} --mean-tokens {args.mean_tokens} "
        f"--repeats {args.repeats}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. {args.prompts} prompts of ~300 "
        f"characters, greedy, per-record output length n (max_tokens = min_tokens = n; fixed n = {args.mean_tokens}, or "
        f"geometric with mean {args.mean_tokens} capped at {args.mean_tokens * 4}), fed in token-budget batches "
        f"({budget} tokens, the worker batcher's default). Output tokens/s per option (ratio to the best in the row); "
        "`identical`: every option returned exactly the static option's completions. Shared 2-core machine: "
        "compare within a row.", "",
        "| dist (p50/max) | repeat | batches | " + " | ".join(f"{b} tok/s (ratio)" for b in BATCHINGS) + " | identical | load |",
        "|---|---|---|" + "---|" * len(BATCHINGS) + "---|---|",
    ]
    for r in rows:
        best = max(r[b] for b in BATCHINGS)
        lines.append(f"| {r['dist']} ({r['p50']}/{r['max']}) | {r['repeat']} | {r['batches']} | "
                     + " | ".join(f"{r[b]:,.0f} ({r[b] / best:.2f})" for b in BATCHINGS) + f" | {r['identical']} | {r['load']} |")
    lines += ["", "Median ratio to the best option per distribution:", "", "| dist | " + " | ".join(BATCHINGS) + " |",
              "|---|" + "---|" * len(BATCHINGS)]
    for dist in ("fixed", "geometric"):
        sub = [r for r in rows if r["dist"] == dist]
        lines.append(f"| {dist} | " + " | ".join(f"{statistics.median(r[b] / max(r[c] for c in BATCHINGS) for r in sub):.2f}"
                                               for b in BATCHINGS) + " |")
    out = Path(args.out if args.out != str(ROOT / "bench/reports/engines.md") else ROOT / "bench/reports/transformers_batching.md")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batching", action="store_true", help="compare the batching options instead (see above)")
    ap.add_argument("--prompts", type=int, default=200, help="--batching: prompts per measurement")
    ap.add_argument("--mean-tokens", type=int, default=32, help="--batching: mean output tokens per record")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per prompt (fixed)")
    ap.add_argument("--out", default=str(ROOT / "bench/reports/engines.md"))
    args = ap.parse_args()
    if args.batching:
        return compare_batching(args)

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-model-")) / "model")
    engine = build_engine({"kind": "transformers", "model": str(model), "device": "cpu", "num_threads": 1,
                           "transformers": {"batching": "static"}})  # fixed lengths: the plain padded cost curve
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
