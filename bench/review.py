"""Human review's storage costs: a verdict's durable write, and the sensor's status read.

A round of ``--records`` records waits for people (human judge, simulated engine, local
disk). Measured side by side in one run:

- claim + durable verdict through the review server's HTTP API (one client, loopback):
  verdicts/s and the latency of each (the time a reviewer waits after a key press);
- ``PipelineRun.review_status`` (what the round sensor reads each tick) with the log as
  the server leaves it (compacted every 200 verdicts) vs the same log uncompacted (one
  segment per verdict): the compaction's worth;
- ``resolve_review`` (closing the round) wall.

    .venv/bin/python bench/review.py [--records 2000]

Writes bench/reports/review.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch_inference import review as rv  # noqa: E402
from batch_inference.pipeline import PipelineRun, PipelineSpec  # noqa: E402
from batch_inference.pipeline.runner import open_runner  # noqa: E402
from batch_inference.review.server import start  # noqa: E402

REPORT = Path(__file__).resolve().parent / "reports" / "review.md"


def spec_for(tmp: Path, records: int) -> PipelineSpec:
    src = tmp / "input.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"prompt": f"question {i}"}) + b"\n" for i in range(records)))
    return PipelineSpec.parse({
        "cache": {"enabled": False},  # benches measure the engine: every run computes its requests (bench/result_cache.py measures the cache)
        "run": "bench-review", "input": str(src), "output": str(tmp / "out"),
        "engine": {"kind": "simulated", "simulated": {"latency_a_s": 0.0, "latency_b_s": 0.0}},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 8}}, "judge": {"kind": "human"},
        "shard_records": 1000, "chunk_size": 500, "pool": {"concurrency": 4},
    })


async def judged(spec: PipelineSpec) -> None:
    async with open_runner(spec) as runner:
        run = PipelineRun(spec, runner)
        await run.shard()
        await run.infer(0)
        await run.judge(0)


async def review_over_http(spec: PipelineSpec, records: int) -> list[float]:
    runner, port = await start(rv.ReviewQueue(spec), "127.0.0.1", 0, default_reviewer="bench")
    url = f"http://127.0.0.1:{port}"
    waits = []
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(records):
                async with s.post(url + "/api/next", json={}) as resp:
                    rec = (await resp.json())["record"]
                t0 = time.perf_counter()
                async with s.post(url + "/api/verdict", json={"round": 0, "id": rec["id"], "verdict": "approve" if i % 3 else "reject"}) as resp:
                    assert resp.status == 200
                waits.append(time.perf_counter() - t0)
    finally:
        await runner.cleanup()
    return waits


def timed(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=2000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-review-"))
    try:
        spec = spec_for(tmp, args.records)
        asyncio.run(judged(spec))
        t0 = time.perf_counter()
        waits = asyncio.run(review_over_http(spec, args.records))
        wall = time.perf_counter() - t0
        run = PipelineRun(spec)
        log = rv.ReviewLog(run.layout, 0, None)
        compacted_segments = len(log.segment_names())
        status_compacted = timed(lambda: run.review_status(0))
        # the same entries, one segment each (what the log would be without compaction)
        flat = tmp / "flat"
        shutil.copytree(tmp / "out", flat)
        flat_spec = spec.model_copy(update={"output": str(flat)})
        flat_log = rv.ReviewLog(PipelineRun(flat_spec).layout, 0, None)
        entries = flat_log.entries()
        for name in flat_log.segment_names():
            os.unlink(os.path.join(flat_log.path, name))
        for e in entries:
            flat_log.append([e])
        status_flat = timed(lambda: PipelineRun(flat_spec).review_status(0), repeat=3)
        t1 = time.perf_counter()
        summary = asyncio.run(run.resolve_review(0))
        resolve_s = time.perf_counter() - t1
        c = run.round_counts(0)
        assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] == args.records
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    waits_ms = sorted(w * 1000 for w in waits)
    lines = [
        "# bench/review.py: human review's storage costs",
        "",
        f"`.venv/bin/python bench/review.py --records {args.records}` — {platform.node()}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}, local disk, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| verdicts through HTTP (claim + durable verdict, one client) | {args.records / wall:.0f} /s |",
        f"| verdict latency after the key press, median / p99 | {statistics.median(waits_ms):.1f} / {waits_ms[int(len(waits_ms) * 0.99) - 1]:.1f} ms |",
        f"| log segments after {args.records} verdicts (server compacts every {rv.COMPACT_EVERY}) | {compacted_segments} |",
        f"| sensor's review_status read, compacted log | {status_compacted * 1000:.1f} ms |",
        f"| same, uncompacted ({len(entries)} segments) | {status_flat * 1000:.1f} ms ({status_flat / status_compacted:.0f}x) |",
        f"| resolve_review (close the round: seal, fold, write outputs) | {resolve_s * 1000:.0f} ms |",
        f"| outcome | {summary.approved} approved, {summary.rejected} rejected, conflicts {summary.conflicts} |",
        "",
        "Humans decide a few records a minute each: the verdict path has room for a large team on one server;",
        "what matters at days of review is that the sensor's 5-second read stays small, which the compaction keeps.",
    ]
    REPORT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
