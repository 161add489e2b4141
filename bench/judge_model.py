"""A judge of its own: the judge on its own pool vs on the infer engine, measured and planned.

The same input runs to the end through the pipeline's own code (``run_pipeline``, in-process
pools) twice per strategy: once with the judge on the infer engine (one pool, one model),
once with the judge on a model of its own (``judge.engine``: a second pool). Both engines
are the SIMULATED linear model with the same cost (``--a-ms`` per batch + ``--b-us`` per
token, slept: the figures are the orchestration around a model of known cost, not any GPU)
and the same approval, so the work is equal and only the placement differs.

Per run: wall, GPU-seconds (each pool is one GPU, held for the whole run: pools x wall) and
each pool's engine-busy share, with the planner's prediction for the same spec
(``planning.make_plan``: engine time, no pipeline overhead) beside it, and each pool's engine
seconds measured and planned.

    python bench/judge_model.py                         # ~1-2 min on 2 shared cores
    python bench/judge_model.py --records 400 --strategies in_place
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

REPORT = Path(__file__).parent / "reports" / "judge_model.md"


def engine(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    return {"kind": "simulated", "seed": seed,
            "simulated": {"latency_a_s": args.a_ms / 1000, "latency_b_s": args.b_us / 1e6, "output_tokens": 16,
                          "approval_rate": args.approval}}


def make_spec(args: argparse.Namespace, root: Path, strategy: str, own: bool) -> Any:
    from batch_inference.pipeline import PipelineSpec

    judge: dict[str, Any] = {"kind": "llm", "template": "Judge: {result}", "max_tokens": 4}
    if own:
        judge["engine"] = engine(args, seed=1)
    return PipelineSpec.parse({
        "cache": {"enabled": False},  # benches measure the engine: every run computes its requests (bench/result_cache.py measures the cache)
        "run": f"{strategy}-{'own' if own else 'shared'}", "input": str(root / "input.jsonl"), "output": str(root / "runs"),
        "engine": engine(args, seed=0), "infer": {"template": "Answer: {prompt}", "sampling": {"max_tokens": 16, "seed": 1}},
        "judge": judge, "strategy": strategy, "max_rounds": args.attempts, "max_attempts": args.attempts,
        "crossover": {"compare_cost": True}, "shard_records": args.shard_records, "chunk_size": args.chunk,
        "pool": {"launcher": "inprocess", "concurrency": args.concurrency, "retries": 1,
                 "batcher": {"batch_timeout_s": 0.005}},
    })


async def measure(spec: Any) -> dict[str, Any]:
    from batch_inference.pipeline import run_pipeline
    from batch_inference.pipeline.runner import PoolPair, open_runner

    t0 = time.perf_counter()
    async with open_runner(spec) as runner:
        summary = await run_pipeline(spec, runner=runner)
        stats = await runner.stats()
    wall = time.perf_counter() - t0
    per_pool = stats if isinstance(runner, PoolPair) else {"infer": stats}
    busy = {name: float(s.get("engine_busy_s") or 0.0) for name, s in per_pool.items()}
    loads = {name: int(s.get("engine_loads") or 0) for name, s in per_pool.items()}
    return {"wall_s": wall, "gpu_s": wall * len(per_pool), "busy": {k: v / wall for k, v in busy.items()}, "engine_s": busy,
            "approved": summary.approved, "records": summary.records, "rounds": summary.rounds, "tail": summary.tail,
            "loads": loads}


def planned(spec: Any) -> dict[str, Any]:
    from batch_inference.planning.plan import make_plan

    s = make_plan(spec, strategies=(spec.strategy,)).for_strategy(spec.strategy)
    busy = {k: p["busy_share"] for k, p in s.pools.items()} or None
    engine = {k: p["engine_hours"] * 3600 for k, p in s.pools.items()} or {"infer": s.engine_s}
    return {"wall_s": s.wall_s, "gpu_s": s.gpu_hours * 3600, "busy": busy, "engine_s": engine, "decisions": s.decisions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000)
    ap.add_argument("--approval", type=float, default=0.5)
    ap.add_argument("--attempts", type=int, default=4)
    ap.add_argument("--shard-records", type=int, default=100)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--a-ms", type=float, default=20.0, help="engine cost per batch call, ms")
    ap.add_argument("--b-us", type=float, default=100.0, help="engine cost per batch token, us")
    ap.add_argument("--strategies", default="rounds,in_place,hybrid")
    ap.add_argument("--report", type=Path, default=REPORT)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-judge-model-") as tmp:
        root = Path(tmp)
        with open(root / "input.jsonl", "wb") as f:
            f.write(b"".join(orjson.dumps({"prompt": f"question {i}"}) + b"\n" for i in range(args.records)))
        for strategy in args.strategies.split(","):
            for own in (False, True):
                spec = make_spec(args, root, strategy, own)
                plan = planned(spec)
                got = asyncio.run(measure(spec))
                rows.append({"strategy": strategy, "judge": "own pool" if own else "infer engine", "measured": got, "planned": plan})
                busy = ", ".join(f"{k} {v:.0%}" for k, v in got["busy"].items())
                print(f"{strategy:9s} judge on {rows[-1]['judge']:12s}: wall {got['wall_s']:6.2f}s (planned {plan['wall_s']:6.2f}s), "
                      f"GPU-s {got['gpu_s']:6.2f} (planned {plan['gpu_s']:6.2f}), busy {busy}, approved {got['approved']}, "
                      f"loads {got['loads']}", flush=True)
    write_report(args, rows)


def seconds(per_pool: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in per_pool.items())


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    load = os.getloadavg()
    lines = [
        "# A judge of its own: on its own pool vs on the infer engine",
        "",
        f"`python bench/judge_model.py --records {args.records} --approval {args.approval} --attempts {args.attempts} "
        f"--a-ms {args.a_ms:g} --b-us {args.b_us:g}` on {platform.node() or 'this machine'} "
        f"({os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end; shared with other work).",
        "",
        "Simulated linear engines of equal cost and approval on both sides, in-process pools "
        f"({args.concurrency} task slots each), {args.records:,} records in shards of {args.shard_records}. "
        "GPU-s = pools x wall (each pool one GPU, held for the whole run); busy = the pool's engine time / wall. "
        "Planned: `make_plan` for the same spec (engine time, the tail's waves priced at their chunk's size; the pipeline's "
        "own overheads are not in it). Engine s: each pool's engine time (measured: the workers' `engine_busy_s`).",
        "",
        "| strategy | judge on | wall s | planned wall s | GPU-s | planned GPU-s | busy (measured) | busy (planned) "
        "| engine s (measured) | engine s (planned) | approved |",
        "|---|---|---:|---:|---:|---:|---|---|---|---|---:|",
    ]
    for r in rows:
        m, p = r["measured"], r["planned"]
        busy = ", ".join(f"{k} {v:.0%}" for k, v in m["busy"].items())
        pbusy = ", ".join(f"{k} {v:.0%}" for k, v in p["busy"].items()) if p["busy"] else "-"
        lines.append(f"| {r['strategy']} | {r['judge']} | {m['wall_s']:.2f} | {p['wall_s']:.2f} | {m['gpu_s']:.2f} | "
                     f"{p['gpu_s']:.2f} | {busy} | {pbusy} | {seconds(m['engine_s'])} | {seconds(p['engine_s'])} | "
                     f"{m['approved']:,} / {m['records']:,} |")
    lines += ["", "Each engine loaded once per pool for the whole run in every row (the workers' own `engine_loads`)."
              if all(set(r["measured"]["loads"].values()) == {1} for r in rows) else "Engine loads: see the printed rows.", ""]
    args.report.write_text("\n".join(lines))
    print(f"wrote {args.report}")


if __name__ == "__main__":
    main()
