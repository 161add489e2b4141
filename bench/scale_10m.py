"""Millions of records end to end on one machine (issue 41 #4): is the driver flat in the records?

One whole run (``run_pipeline``: preflight, the shard step, round 0, finalize with its
conservation check) over an input generated here, on a **local pool of two workers** with
the zero-cost simulated engine (``latency_a_s: 0, latency_b_s: 0``), so every second is the
pipeline's own: reading, resharding, dispatch, rendering, the workers' engine path, writing,
the ledger and the conservation check.

Measured:

- the run's wall and records/s, and each step's wall from the ledger;
- the driver's RSS, sampled every ``--sample-s`` in a thread (psutil) through the whole run:
  its peak, and its peak in each tenth of the run (flat means the same at 1M and 10M);
  the workers' RSS beside it (they are the pool's processes, not the driver's);
- the ledger read back (``Ledger.view``) and the conservation check run again after the run
  (``check_conservation`` over ``terminal_sources``), each timed, with its Python heap peak
  (tracemalloc) and the driver's RSS growth;
- bytes written per record: every file under the run's folder, by top folder.

The figures of each ``--records`` go into bench/reports/scale_10m.json (keyed by the
records: run 1M, 3M and 10M one after another) and the report is rebuilt from every row.

    .venv/bin/python bench/scale_10m.py --records 1000000
    nohup .venv/bin/python bench/scale_10m.py --records 10000000 > /tmp/scale_10m.log 2>&1 &

The input and the run's folder are under ``--workdir`` (default: a temporary folder), removed
after unless ``--keep``: 10M records take ~6 GB there while the run lasts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch_inference.pipeline import Ledger, PipelineRun, PipelineSpec, RunLayout, run_pipeline  # noqa: E402
from batch_inference.pipeline.ledger import check_conservation  # noqa: E402
from batch_inference.pool.launchers.local import LocalLauncher  # noqa: E402

ROOT = Path(__file__).resolve().parent
REPORT = ROOT / "reports" / "scale_10m.md"
TOPICS = ("billing", "shipping", "returns", "login", "refund", "warranty", "pricing", "delivery")


def write_input(path: Path, records: int) -> int:
    """Short classification requests (~110 bytes a line), every prompt distinct; returns bytes written."""
    with open(path, "wb", buffering=1 << 20) as f:
        for start in range(0, records, 100_000):
            f.write(b"".join(
                orjson.dumps({"id": f"r{i:09d}", "prompt": f"Ticket {i}: customer asks about {TOPICS[i % 8]} "
                                                              f"order {i * 7919 % 1_000_003}. Label it."}) + b"\n"
                for i in range(start, min(records, start + 100_000))))
    return path.stat().st_size


def make_spec(src: Path, out: Path, run: str, args: argparse.Namespace) -> PipelineSpec:
    return PipelineSpec.parse({
        # off: every run computes its requests; --result-cache: on, as a user's spec has it (every request a miss and a write)
        "cache": {"enabled": args.result_cache},
        "run": run, "input": str(src), "output": str(out),
        "engine": {"kind": "simulated", "simulated": {"latency_a_s": 0.0, "latency_b_s": 0.0, "output_tokens": 4}},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 4, "temperature": 0.0}},
        "strategy": "rounds", "max_rounds": 1, "shard_records": args.shard_records,
        "layout": {"prefix": args.layout},
        "pool": {"launcher": "local", "replicas": args.replicas, "concurrency": args.concurrency, "retries": 0,
                 "name": run, "idle_ttl_s": None},
    })


class RssSampler:
    """The driver's RSS (and its pool's workers') every ``every_s`` seconds, in a thread."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, int, int]] = []  # (seconds since start, driver RSS, workers' RSS)
        self.me = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.t0 = time.perf_counter()

    def _workers_rss(self) -> int:
        """The pool's workers: the driver's child processes (the local launcher spawns them)."""
        total = 0
        for p in self.me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        tick = 0
        workers = 0
        while not self._stop.is_set():
            if tick % 10 == 0:  # the process table is dearer to walk: every 10th sample
                workers = self._workers_rss()
            self.samples.append((time.perf_counter() - self.t0, self.me.memory_info().rss, workers))
            tick += 1
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def deciles(self) -> list[int]:
        """The driver's peak RSS in each tenth of the sampled time."""
        if not self.samples:
            return []
        end = self.samples[-1][0] or 1.0
        peaks = [0] * 10
        for t, rss, _ in self.samples:
            k = min(9, int(10 * t / end))
            peaks[k] = max(peaks[k], rss)
        for k in range(1, 10):  # a tenth with no sample (a short run) shows the one before
            peaks[k] = peaks[k] or peaks[k - 1]
        return peaks


def measured(fn: Any, *, heap: bool) -> tuple[Any, float, int, int]:
    """``fn()``'s result, seconds, Python heap peak and the driver's peak RSS growth over it.

    ``heap`` traces the heap (tracemalloc), which slows allocation-heavy code several times:
    then the seconds are not the figure (0 returned for them)."""
    me = psutil.Process()
    rss0 = me.memory_info().rss
    sampler = RssSampler(0.2)
    if heap:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with sampler:
            out = fn()
        seconds = 0.0 if heap else time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] if heap else 0
    finally:
        if heap:
            tracemalloc.stop()
    return out, seconds, peak, max([s[1] for s in sampler.samples] + [me.memory_info().rss]) - rss0


def bytes_under(root: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for dirpath, _, files in os.walk(root):
        top = Path(dirpath).relative_to(root).parts[:1]
        key = top[0] if top else "."
        sizes[key] = sizes.get(key, 0) + sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return sizes


async def measure(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    src = base / "input.jsonl"
    t0 = time.perf_counter()
    input_bytes = write_input(src, args.records)
    gen_s = time.perf_counter() - t0
    run = f"scale-{args.records}"
    spec = make_spec(src, base / "out", run, args)
    load0 = os.getloadavg()
    sampler = RssSampler(args.sample_s)
    me = psutil.Process()
    rss_before = me.memory_info().rss
    cpu0 = me.cpu_times()
    try:
        with sampler:
            t0 = time.perf_counter()
            summary = await run_pipeline(spec)
            wall = time.perf_counter() - t0
            cpu1 = me.cpu_times()
    finally:
        await asyncio.to_thread(LocalLauncher(None, name=run).down)
    load1 = os.getloadavg()
    assert summary.conservation.ok, summary.conservation
    assert summary.records == args.records and summary.approved == args.records, summary
    layout = RunLayout(spec.output, spec.run)
    view, ledger_s, _, _ = measured(lambda: Ledger(layout).view(), heap=False)
    _, _, ledger_heap, ledger_rss = measured(lambda: Ledger(layout).view(), heap=True)
    assert view.shard is not None and view.rounds and view.rounds[0].infer is not None
    pr = PipelineRun(spec)
    report, cons_s, _, cons_rss = measured(  # timed untraced; its heap traced on a smaller run (--conservation-heap)
        lambda: check_conservation(pr.terminal_sources(), input_records=args.records), heap=False)
    cons_heap = 0
    if args.conservation_heap:
        _, _, cons_heap, _ = measured(lambda: check_conservation(pr.terminal_sources(), input_records=args.records), heap=True)
    assert report.ok
    written = bytes_under(Path(layout.root))
    rss = [s[1] for s in sampler.samples]
    workers = [s[2] for s in sampler.samples if s[2]]
    return {
        "records": args.records, "replicas": args.replicas, "concurrency": args.concurrency,
        "shard_records": args.shard_records, "layout_prefix": args.layout,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(), "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in load1],
        "input_bytes": input_bytes, "input_gen_s": round(gen_s, 1),
        "wall_s": round(wall, 1), "records_per_s": round(args.records / wall),
        "shard_s": round(view.shard.wall_s, 1), "infer_s": round(view.rounds[0].infer.wall_s, 1),
        "finalize_s": round(wall - view.shard.wall_s - view.rounds[0].infer.wall_s, 1),
        "shards": view.shard.shards,
        "driver_cpu_s": round(cpu1.user + cpu1.system - cpu0.user - cpu0.system, 1),
        "driver_rss_before_mb": round(rss_before / 2**20, 1),
        "driver_rss_peak_mb": round(max(rss) / 2**20, 1), "driver_rss_deciles_mb": [round(x / 2**20, 1) for x in sampler.deciles()],
        "workers_rss_peak_mb": round(max(workers) / 2**20, 1) if workers else None,
        "samples": len(rss),
        "ledger_view_s": round(ledger_s, 3), "ledger_view_heap_mb": round(ledger_heap / 2**20, 2),
        "ledger_view_rss_growth_mb": round(ledger_rss / 2**20, 1),
        "conservation_s": round(cons_s, 1), "conservation_heap_mb": round(cons_heap / 2**20, 2) if cons_heap else None,
        "conservation_rss_growth_mb": round(cons_rss / 2**20, 1), "conservation_method": report.method,
        "bytes_written": sum(written.values()), "bytes_per_record": round(sum(written.values()) / args.records, 1),
        "bytes_by_folder": written,
        "result_cache": args.result_cache,
        "result_cache_store": {k: v for k, v in summary.result_cache.items() if k in ("entries", "bytes", "error")}
                              if args.result_cache else None,
    }


def cpu(r: dict[str, Any]) -> str:
    """The driver's CPU seconds over the run, a record's and a shard task's share (rows before it: -)."""
    if "driver_cpu_s" not in r:
        return "-"
    return f"{r['driver_cpu_s']:,.0f} ({1e6 * r['driver_cpu_s'] / r['records']:.0f}, {1e3 * r['driver_cpu_s'] / r['shards']:.0f})"


def cache_cell(r: dict[str, Any]) -> str:
    """Off, or on with what the store held at the run's end."""
    store = r.get("result_cache_store")
    if not r.get("result_cache") or not store:
        return "off"
    if "error" in store:
        return f"on (trim failed: {store['error']})"
    return f"on: {store['entries']:,} entries, {store['bytes'] / 2**20:,.0f} MB"


def render(rows: list[dict[str, Any]]) -> str:
    rows = sorted(rows, key=lambda r: (r["records"], bool(r.get("result_cache"))))
    lines = [
        "# Millions of records on one machine: the driver stays flat",
        "",
        "`bench/scale_10m.py --records N` (one run per N): one whole `run_pipeline` (preflight, shard step, round 0, "
        "finalize + conservation) on a local pool of 2 workers, the zero-cost simulated engine (`latency_a_s: 0, "
        "latency_b_s: 0`, 4 output tokens), JSONL input of short distinct prompts (~110 bytes a line) generated by "
        "the bench, shards of 20,000, no judge, one round, result cache off unless the row says (`--result-cache`), `layout.prefix: false` (unique prompts: "
        "nothing to share; the layout pass's cost is bench/reports/layout_cost.md). Driver RSS sampled every 0.5 s "
        "(psutil, a thread in the driver's process).",
        "",
        "| records | result cache | wall s | records/s | shard step s | infer s | finalize s | driver CPU s (µs / record, ms / shard task) | driver RSS peak MB | driver RSS by tenth of the run (MB) | workers' RSS peak MB (both) | load 1-min before / after | when |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['records']:,} | {cache_cell(r)} | {r['wall_s']:,.0f} | {r['records_per_s']:,} | {r['shard_s']:,.0f} | {r['infer_s']:,.0f} | "
            f"{r['finalize_s']:,.0f} | {cpu(r)} | {r['driver_rss_peak_mb']:.0f} | {' '.join(f'{x:.0f}' for x in r['driver_rss_deciles_mb'])} | "
            f"{r['workers_rss_peak_mb'] or 0:.0f} | {r['load_before'][0]} / {r['load_after'][0]} | {r['when']} |")
    lines += [
        "",
        "| records | result cache | ledger view s | its heap peak MB | conservation check s | its heap peak MB (traced run) | its peak RSS growth MB | bytes written / record | by folder (bytes / record) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        folders = ", ".join(f"{k} {v / r['records']:.0f}" for k, v in sorted(r["bytes_by_folder"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r['records']:,} | {cache_cell(r)} | {r['ledger_view_s']:.3f} | {r['ledger_view_heap_mb']:.2f} | {r['conservation_s']:.1f} | "
            f"{r['conservation_heap_mb'] or '-'} | {r['conservation_rss_growth_mb']:.1f} | {r['bytes_per_record']:.0f} | {folders} |")
    if len(rows) > 1:
        lo, hi = rows[0], rows[-1]
        lines += ["", f"Driver RSS peak, {hi['records']:,} / {lo['records']:,} records: "
                      f"**{hi['driver_rss_peak_mb'] / lo['driver_rss_peak_mb']:.2f}x** (target <= 1.2x)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--shard-records", type=int, default=20_000)
    ap.add_argument("--layout", action="store_true", help="layout.prefix on (default off: unique prompts)")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--workdir", type=Path, default=None, help="where the input and the run go (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the input and the run's folder")
    ap.add_argument("--conservation-heap", action="store_true",
                    help="also trace the conservation check's heap (tracemalloc: several times its time again)")
    ap.add_argument("--result-cache", action="store_true", help="the result cache on (a spec's default; off by default here)")
    ap.add_argument("--report", type=Path, default=REPORT)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bi-scale-", dir=args.workdir))
    try:
        row = asyncio.run(measure(args, base))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    store = args.report.with_suffix(".json")
    rows = [r for r in (json.loads(store.read_text()) if store.exists() else [])
            if (r["records"], bool(r.get("result_cache"))) != (args.records, args.result_cache)] + [row]
    store.write_text(json.dumps(sorted(rows, key=lambda r: (r["records"], bool(r.get("result_cache")))), indent=1))
    text = render(rows)
    args.report.write_text(text)
    print(json.dumps(row, indent=1))
    print(text)


if __name__ == "__main__":
    main()
