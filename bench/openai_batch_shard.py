"""Benchmark: the sharding pass over an OpenAI Batch file vs the same requests as native JSONL.

    .venv/bin/python bench/openai_batch_shard.py [--records 1000000]

Writes N chat requests as an OpenAI Batch file (``{custom_id, method, url, body}``, ~300
bytes a line) and the same requests as native records (what the conversion produces),
then shards each in its own fresh process with the pipeline's own pass
(``passes.shard_input`` -> 20,000-record zstd shards; the OpenAI side converts every line,
collects file-level problems and checks custom_ids for duplicates). Prints records/s,
the OpenAI/native ratio measured side by side in one run, and each process's peak RSS
(which includes the duplicate-id Bloom filter, 64 MiB); writes bench/reports/openai_batch_shard.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_inputs(n: int, openai_path: Path, native_path: Path) -> None:
    from batch_inference.prompting.openai_batch import OpenAIBatchReader

    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(2000)]
    reader = OpenAIBatchReader(models=frozenset({"tiny"}))
    with open(openai_path, "wb", buffering=1 << 20) as fo, open(native_path, "wb", buffering=1 << 20) as fn:
        for i in range(n):
            line = {"custom_id": f"request-{i:09d}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "tiny", "max_tokens": 128, "temperature": 0.7,
                             "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                          {"role": "user", "content": " ".join(rng.choices(vocab, k=24))}]}}
            fo.write(orjson.dumps(line) + b"\n")
            fn.write(orjson.dumps(reader.convert(line, i)) + b"\n")


def child(mode: str, src: str, dst: str) -> None:
    """One sharding pass in this (fresh) process; prints a JSON line of figures."""
    from batch_inference.pipeline import passes
    from batch_inference.pipeline.inputs import check_openai_input
    from batch_inference.prompting.openai_batch import OpenAIBatchReader

    reader = OpenAIBatchReader(models=frozenset({"tiny"})) if mode == "openai" else None
    t0 = time.perf_counter()
    report = passes.shard_input(src, dst, records_per_shard=20_000, transform=reader.convert if reader else None)
    if reader is not None:
        check_openai_input(reader, report, src)
    wall = time.perf_counter() - t0
    print(json.dumps({"mode": mode, "records": report.records, "shards": report.shards, "wall_s": wall,
                      "records_per_s": report.records / wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_child(mode: str, src: Path, dst: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(src), str(dst)], check=True,
                         capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=1, help="alternate native/openai this many times; best of each")
    p.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "DST"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench" / "reports" / "openai_batch_shard.md"))
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-openai-"))
    try:
        openai_path, native_path = tmp / "batch.jsonl", tmp / "native.jsonl"
        t0 = time.perf_counter()
        write_inputs(a.records, openai_path, native_path)
        print(f"wrote {a.records:,} requests in {time.perf_counter() - t0:.1f} s: OpenAI Batch "
              f"{openai_path.stat().st_size / 1e6:,.0f} MB, native {native_path.stat().st_size / 1e6:,.0f} MB")
        best: dict[str, dict] = {}
        for _ in range(a.repeats):
            for mode, src in (("native", native_path), ("openai", openai_path)):
                shutil.rmtree(tmp / f"out-{mode}", ignore_errors=True)
                r = run_child(mode, src, tmp / f"out-{mode}")
                print(f"{mode:>7}: {r['records']:,} records -> {r['shards']} shards in {r['wall_s']:.2f} s "
                      f"({r['records_per_s']:,.0f} records/s), peak RSS {r['peak_rss_mb']:,.0f} MB")
                if mode not in best or r["records_per_s"] > best[mode]["records_per_s"]:
                    best[mode] = r
        ratio = best["openai"]["records_per_s"] / best["native"]["records_per_s"]
        print(f"OpenAI Batch / native sharding throughput: {ratio:.2f}")
        load = os.getloadavg()[0]
        Path(a.out).write_text("\n".join([
            "# Sharding an OpenAI Batch file (bench/openai_batch_shard.py)",
            "",
            f"`python bench/openai_batch_shard.py --records {a.records} --repeats {a.repeats}`; load average at the end {load:.1f}",
            f"(2 shared cores). {a.records:,} chat requests (system + user turn, ~"
            f"{openai_path.stat().st_size / a.records:.0f} bytes a line) sharded into 20,000-record zstd shards by the "
            "pipeline's own pass, each side in a fresh process, best of the repeats.",
            "",
            "| input | records/s | wall s | peak RSS MB |",
            "|---|---:|---:|---:|",
            *(f"| {name} | {best[m]['records_per_s']:,.0f} | {best[m]['wall_s']:.2f} | {best[m]['peak_rss_mb']:,.0f} |"
              for m, name in (("native", "native JSONL (the converted records)"), ("openai", "OpenAI Batch (converted + checked)"))),
            "",
            f"OpenAI Batch / native throughput: **{ratio:.2f}** (same run, same requests). Records stream one at a "
            f"time: peak RSS ({best['openai']['peak_rss_mb']:,.0f} MB for a {openai_path.stat().st_size / 1e6:,.0f} MB "
            "file) is the interpreter, zstd buffers and the 64 MiB duplicate-id Bloom filter, not the data. The "
            "difference is the per-line conversion (a new record dict, the body-field and model checks).",
            "",
        ]))
        print(f"report: {a.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
