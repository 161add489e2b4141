"""Round 0 beside the layout pass's rewrite (``layout.stream``) against round 0 after it, on a real S3.

The layout pass ends by rewriting ``sharded/`` in prefix order, one shard object after another;
on an object store each shard is a PUT, so at thousands of shards the rewrite takes a while with
the pool open. With ``layout.stream`` on (the default of a whole run), round 0's infer phase
starts on each shard as it commits (``pipeline.stream``); off, after the last one. This bench
runs the same spec both ways, alternated, in the same session:

- SeaweedFS on loopback behind the tests' TCP proxy (``--latency-ms`` added to every round trip);
- documents x questions, question-major (out of prefix order: the pass rewrites every shard);
- the simulated engine with a fixed cost a call (``--call-ms``) in an in-process pool: a task's
  wall stands for the GPU's;
- one round (approval 1.0), the result cache off.

Reported per run: the wall of ``run_pipeline``; the time from its start to the first task
(while the pool is open every GPU waits); the shard step's wall and its rewrite (the ledger's);
round 0's infer phase. The figure is the median of the per-repeat ratios, streamed / whole.

    .venv/bin/python bench/stream_round0.py                 # 4,000 records, shards of 20, 20 ms, 3 repeats

Writes bench/reports/stream_round0.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _raw_vllm import load, write_report  # noqa: E402
from ledger_overhead import store  # noqa: E402

from batch_inference.pipeline import PipelineSpec, run_pipeline  # noqa: E402
from batch_inference.pool.protocol import TaskResult, TaskSpec  # noqa: E402
from batch_inference_tests.pipeline.helpers import CountingRunner  # noqa: E402

REPORT = Path(__file__).resolve().parent / "reports" / "stream_round0.md"
QUESTIONS = 8


def write_input(path: Path, records: int, chars: int) -> None:
    """Documents x questions, question-major: every document's questions far apart."""
    docs = max(1, records // QUESTIONS)
    body = "the quick brown fox jumps over a lazy dog " * (chars // 43 + 1)
    with open(path, "wb") as f:
        for q in range(QUESTIONS):
            for d in range(docs):
                f.write(orjson.dumps({"id": f"d{d:05d}q{q}", "prompt": f"document {d}: {body[:chars]} question {q}?"}) + b"\n")


def spec_for(data: Path, base: str, options: dict[str, Any], run: str, args: argparse.Namespace, stream: bool) -> PipelineSpec:
    return PipelineSpec.parse({
        "cache": {"enabled": False}, "run": run, "input": str(data), "output": base, "storage_options": options,
        "engine": {"kind": "simulated", "simulated": {"approval_rate": 1.0, "latency_a_s": args.call_ms / 1000,
                                                      "latency_b_s": 0.0}},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 4}},
        "judge": {"kind": "llm", "template": "{result}"}, "strategy": "rounds", "max_rounds": 1,
        "shard_records": args.shard_records, "chunk_size": args.shard_records,
        "pool": {"launcher": "inprocess", "concurrency": args.concurrency},
        "layout": {"stream": stream, "signature": "text"},
    })


class FirstTask(CountingRunner):
    """The in-process pool, noting when the first infer task was sent."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.first: float | None = None

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        if spec.kind == "infer" and self.first is None:
            self.first = time.perf_counter()
        return await super().run_task(spec)


async def one(spec: PipelineSpec, options: dict[str, Any]) -> dict[str, Any]:
    from batch_inference.pipeline import Ledger, RunLayout
    from batch_inference.pipeline.runner import open_runner

    async with open_runner(spec) as pool:
        runner = FirstTask(pool)
        t0 = time.perf_counter()
        summary = await run_pipeline(spec, runner=runner)
        wall = time.perf_counter() - t0
    ledger = Ledger(RunLayout(spec.output, spec.run), options)
    shard, infer = ledger.read(RunLayout.SHARD) or {}, ledger.read(RunLayout.step_name(0, "infer")) or {}
    laid = shard.get("layout") or {}
    assert summary.conservation["ok"] and summary.approved == shard["records"], summary
    return {"wall_s": round(wall, 3), "first_task_s": round((runner.first or t0) - t0, 3),
            "shard_s": round(float(shard["wall_s"]), 3), "layout_applied": bool(laid.get("applied")),
            "layout_sort_s": round(float(laid.get("sort_s", 0.0)), 3), "shards": int(shard["shards"]),
            "infer_s": round(float(infer["wall_s"]), 3), "records": int(shard["records"])}


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bi-stream-bench-") as tmp, \
            store("seaweedfs", Path(tmp), args.latency_ms) as (base, _direct, proxied, _proxy):
        data = Path(tmp) / "input.jsonl"
        write_input(data, args.records, args.chars)
        for rep in range(args.repeats):
            for stream in ((True, False) if rep % 2 == 0 else (False, True)):
                spec = spec_for(data, base, proxied, f"r{rep}-{'stream' if stream else 'whole'}", args, stream)
                row = {"repeat": rep, "stream": stream, **await one(spec, proxied)}
                print(orjson.dumps(row).decode(), flush=True)
                rows.append(row)
    return rows


def report(args: argparse.Namespace, rows: list[dict[str, Any]], wall: float, before: float, after: float) -> str:
    by = {(r["repeat"], r["stream"]): r for r in rows}
    reps = sorted({r["repeat"] for r in rows})
    ratio = statistics.median(by[(i, True)]["wall_s"] / by[(i, False)]["wall_s"] for i in reps)
    saved = statistics.median(by[(i, False)]["wall_s"] - by[(i, True)]["wall_s"] for i in reps)
    lines = [
        "# Round 0 beside the layout pass's rewrite, on SeaweedFS with latency",
        "",
        f"`.venv/bin/python bench/stream_round0.py --records {args.records} --shard-records {args.shard_records} "
        f"--latency-ms {args.latency_ms:g} --call-ms {args.call_ms:g} --concurrency {args.concurrency} --repeats {args.repeats}`: "
        f"{args.records:,} records of documents x {QUESTIONS} questions, question-major, ~{args.chars} characters a prompt, "
        f"shards of {args.shard_records}; SeaweedFS on loopback behind the tests' TCP proxy, {args.latency_ms:g} ms added "
        f"to every round trip; the simulated engine at {args.call_ms:g} ms a call, an in-process pool of "
        f"{args.concurrency} slots; one round; text signatures. The two modes alternate within each repeat. "
        f"{platform.node()}, {len(__import__('os').sched_getaffinity(0))} cores, load {before:.1f} before, {after:.1f} "
        f"after; {wall:.0f} s in all.",
        "",
        "| repeat | round 0 | run wall s | first task at s | shard step s (layout sort + rewrite) | shards | round 0 infer s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['repeat']} | {'beside the rewrite' if r['stream'] else 'after the pass'} | {r['wall_s']:.2f} | "
                     f"{r['first_task_s']:.2f} | {r['shard_s']:.2f} ({r['layout_sort_s']:.2f}) | {r['shards']} | {r['infer_s']:.2f} |")
    lines += [
        "",
        f"**Run wall, beside / after: median {ratio:.3f}** ({saved:.2f} s saved a run, median); the first task goes out "
        f"at a median {statistics.median(by[(i, True)]['first_task_s'] for i in reps):.2f} s beside the rewrite against "
        f"{statistics.median(by[(i, False)]['first_task_s'] for i in reps):.2f} s after the pass.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=4_000)
    ap.add_argument("--chars", type=int, default=400)
    ap.add_argument("--shard-records", type=int, default=20)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--call-ms", type=float, default=50.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", default=str(REPORT))
    args = ap.parse_args()
    t0, before = time.perf_counter(), load()
    rows = asyncio.run(measure(args))
    write_report(Path(args.report), report(args, rows, time.perf_counter() - t0, before, load()), rows)


if __name__ == "__main__":
    main()
