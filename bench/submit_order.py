"""Does longest-predicted-output-first shorten a phase's tail? Measured, on the pipeline's infer phase.

Each record asks for its own output length (``max_tokens = min_tokens = n``: the predictor
is exact, the best case for the rule), drawn from a geometric and a heavy-tailed (Pareto)
distribution. The same records run through one round of the pipeline in three orders:

- ``input``: as drawn (lengths in no order);
- ``chunk_longest``: each shard's records sorted longest first (tasks take turns for
  engine slots, so every task's longest requests go in first: close to a global order);
- ``global_longest``: the whole input sorted longest first (shard 0 the longest records).

``layout.prefix`` is off (nothing is shared; the order tested is the only one). The phase
wall is the makespan: ten shards run at once, so the last task's end is the phase's tail.

    .venv/bin/python bench/submit_order.py                                 # simulated decode engine (vllm-cpu-tiny)
    env=$(bash .ci/vllm_cpu_env.sh); PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 $env/bin/python bench/submit_order.py --engine vllm

Writes bench/reports/submit_order.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPORTS = Path(__file__).resolve().parent / "reports"
ORDERS = ("input", "chunk_longest", "global_longest")


def lengths(dist: str, n: int, mean: int, cap: int, rng: random.Random) -> list[int]:
    out = []
    for _ in range(n):
        if dist == "geometric":
            x = 1
            while rng.random() > 1.0 / mean:
                x += 1
        else:  # Pareto, alpha 1.3, scaled to the mean
            alpha = 1.3
            x = round(mean * (alpha - 1) / alpha / (1.0 - rng.random()) ** (1.0 / alpha))
        out.append(max(1, min(cap, x)))
    return out


def engine_config(kind: str, model: str | None) -> dict[str, Any]:
    if kind == "vllm":
        return {"kind": "vllm", "model": model, "dtype": "float32", "max_model_len": 2048,
                "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False}}}
    return {"kind": "simulated", "simulated": {"cost_model": "decode", "scheduling": "continuous", "profile": "vllm-cpu-tiny"}}


def ordered(records: list[dict[str, Any]], order: str, shard: int) -> list[dict[str, Any]]:
    key = lambda r: -r["sampling"]["max_tokens"]  # noqa: E731
    if order == "global_longest":
        return sorted(records, key=key)
    if order == "chunk_longest":
        return [r for i in range(0, len(records), shard) for r in sorted(records[i:i + shard], key=key)]
    return records


async def run_once(kind: str, model: str | None, root: Path, name: str, records: list[dict[str, Any]], shard: int, pool: Any) -> dict[str, Any]:
    import orjson

    from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout, run_pipeline

    data = root / f"{name}.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    spec = PipelineSpec.parse({
        "cache": {"enabled": False},  # benches measure the engine: every run computes its requests (bench/result_cache.py measures the cache)
        "run": name, "input": str(data), "output": str(root / "runs"), "engine": engine_config(kind, model),
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 2048, "temperature": 1.0, "seed": 1}},
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": ""}},
        "strategy": "rounds", "max_rounds": 1, "shard_records": shard, "chunk_size": 10_000,
        "pool": {"launcher": "inprocess", "concurrency": 10}, "layout": {"prefix": False},
    })
    await run_pipeline(spec, runner=pool)
    infer = Ledger(RunLayout(spec.output, spec.run)).view().rounds[0].infer
    assert infer is not None
    return {"wall_s": infer.wall_s, "longest_task_s": infer.longest_task_s, "tok_s": infer.tokens_out / infer.wall_s}


async def measure(args: argparse.Namespace, model: str | None, root: Path) -> list[dict[str, Any]]:
    from batch_inference.pool import InProcessPool

    rows = []
    async with InProcessPool(engine_config(args.engine, model), concurrency=10) as pool:
        for rep in range(args.repeats):
            for dist in args.dists.split(","):
                rng = random.Random(f"{dist}-{rep}")
                lens = lengths(dist, args.records, args.mean, args.cap, rng)
                base = [{"id": f"r{i:06d}", "prompt": f"[{dist} {rep}] question {i}: " + " ".join(rng.choice("abcdefgh") * 3 for _ in range(40)),
                         "sampling": {"max_tokens": n, "min_tokens": n}} for i, n in enumerate(lens)]
                row: dict[str, Any] = {"dist": dist, "repeat": rep, "tokens": sum(lens), "max": max(lens)}
                orders = ORDERS if rep % 2 == 0 else tuple(reversed(ORDERS))
                for order in orders:
                    recs = [{**r, "prompt": f"<{order}> {r['prompt']}"} for r in ordered(base, order, args.records // 10)]
                    row[order] = await run_once(args.engine, model, root, f"{dist}-{rep}-{order}", recs, args.records // 10, pool)
                rows.append(row)
                print({k: (round(v["wall_s"], 2) if isinstance(v, dict) else v) for k, v in row.items()}, flush=True)
    return rows


def report(args: argparse.Namespace, rows: list[dict[str, Any]], wall: float, before: float, after: float) -> str:
    lines = ["# Longest-predicted-output-first: does it shorten the infer phase's tail?", "",
             f"`{' '.join(sys.argv)}` on {platform.node()} ({os.cpu_count()} CPUs, shared), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {wall:.0f} s; load {before} before, {after} after. "
             f"Engine: {args.engine}. {args.records} records a run, 10 shards running at once, output lengths per record "
             f"(max_tokens = min_tokens: the prediction is exact), mean {args.mean}, cap {args.cap}. Phase wall = the "
             "infer phase's makespan (the ledger's wall); every order decodes the same tokens.", "",
             "| dist (tokens, max) | repeat | input s | chunk_longest s | global_longest s | chunk / input | global / input |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        i, c, g = (r[o]["wall_s"] for o in ORDERS)
        lines.append(f"| {r['dist']} ({r['tokens']:,}, {r['max']}) | {r['repeat']} | {i:.2f} | {c:.2f} | {g:.2f} | {c / i:.3f} | {g / i:.3f} |")
    lines += ["", "| dist | median chunk / input | median global / input |", "|---|---|---|"]
    for dist in args.dists.split(","):
        rs = [r for r in rows if r["dist"] == dist]
        lines.append(f"| {dist} | {statistics.median(r['chunk_longest']['wall_s'] / r['input']['wall_s'] for r in rs):.3f} | "
                     f"{statistics.median(r['global_longest']['wall_s'] / r['input']['wall_s'] for r in rs):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["simulated", "vllm"], default="simulated")
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--mean", type=int, default=96)
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--dists", default="geometric,heavy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", help="default bench/reports/submit_order[_vllm].md")
    args = ap.parse_args()
    t0, before = time.perf_counter(), round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="submit-order-") as tmp:
        root = Path(tmp)
        model = None
        if args.engine == "vllm":
            from batch_inference.engines import make_tiny_model

            model = str(make_tiny_model(root / "model", seed=0))
        rows = asyncio.run(measure(args, model, root))
    text = report(args, rows, time.perf_counter() - t0, before, round(os.getloadavg()[0], 2))
    path = Path(args.report) if args.report else REPORTS / ("submit_order.md" if args.engine == "simulated" else "submit_order_vllm.md")
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
