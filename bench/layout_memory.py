"""Peak memory of the prefix-aware layout pass: flat in the number of records.

Writes N synthetic records (documents x questions, interleaved: every document once per
question, so the pass finds sharing and sorts and rewrites everything) as a zstd JsonlDir,
then runs ``pipeline.placement.layout_by_prefix`` over it in a child process under
``/usr/bin/time -v`` and reads its maximum resident set size. Signatures come from the
simulated engine's tokenizer (4 characters a token; no model tokenizer), blocks of 16.

    .venv/bin/python bench/layout_memory.py --records 1000000,10000000

Writes bench/reports/layout_memory.md. Needs ~0.1 GB of disk per million records (input,
spill and output, zstd), under --dir (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPORTS = Path(__file__).resolve().parent / "reports"
QUESTIONS = 8
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
TEMPLATE = "Document: {doc}\nQuestion: {q}\nAnswer:"


def doc_text(d: int) -> str:
    rng = random.Random(d)
    return f"doc {d} " + " ".join(rng.choice(WORDS) for _ in range(40))  # ~250 characters: ~3 blocks of 64


def generate(url: str, n: int) -> None:
    """``n`` records, question-major (each document's questions far apart), as 20,000-record shards."""
    import orjson

    from batch_inference.storage import JsonlDir

    docs = max(1, n // QUESTIONS)
    with JsonlDir(url).writer_sync(max_records_per_shard=20_000, compression="zstd") as w:
        i = 0
        for q in range(QUESTIONS):
            for d in range(docs):
                if i >= n:
                    break
                w.write_lines([orjson.dumps({"id": f"{i:012d}", "doc": doc_text(d), "q": f"question {q} on it?"},
                                            option=orjson.OPT_APPEND_NEWLINE)])
                i += 1


def child(url: str, spill: str) -> None:
    """The measured process: the layout pass alone."""
    from batch_inference.pipeline.placement import layout_by_prefix
    from batch_inference.prompting import InferConfig
    from batch_inference.prompting.prefix import CharTokens, PrefixSigner

    t0 = time.perf_counter()
    summary = layout_by_prefix(url, signer=PrefixSigner(CharTokens(4), block_size=16, max_blocks=128),
                               infer=InferConfig(template=TEMPLATE), records_per_shard=20_000, spill_url=spill)
    print("@@layout " + json.dumps({**summary.as_dict(), "wall_s": time.perf_counter() - t0}), flush=True)


def measure(n: int, root: Path) -> dict:
    data, spill = root / f"in-{n}", root / f"spill-{n}"
    t0 = time.perf_counter()
    generate(str(data), n)
    gen_s = time.perf_counter() - t0
    cmd = ["/usr/bin/time", "-v", sys.executable, __file__, "--child", str(data), str(spill)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    line = next(x for x in done.stdout.splitlines() if x.startswith("@@layout "))
    out = {"records": n, "max_rss_mb": rss_kb / 1024, "generate_s": gen_s, **json.loads(line[len("@@layout "):])}
    stored = sum(f.stat().st_size for f in data.glob("*.zst"))
    out["stored_mb"] = stored / 2**20
    import shutil

    shutil.rmtree(data, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", default="1000000,10000000")
    ap.add_argument("--dir", help="where the data goes (default: a temporary directory)")
    ap.add_argument("--report", help="default bench/reports/layout_memory.md")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    rows = []
    t0, before = time.perf_counter(), round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="layout-memory-", dir=args.dir) as tmp:
        for n in (int(x) for x in args.records.split(",")):
            rows.append(measure(n, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    after = round(os.getloadavg()[0], 2)
    base = rows[0]["max_rss_mb"]
    lines = ["# Peak memory of the prefix-aware layout pass", "",
             f"`{' '.join(sys.argv)}` on {platform.node()} ({os.cpu_count()} CPUs, shared), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.perf_counter() - t0:.0f} s in all; load {before} before, "
             f"{after} after. Synthetic documents x {QUESTIONS} questions, question-major (interleaved), template "
             f"`{TEMPLATE!r}`; signatures by the simulated engine's tokenizer (4 characters a token), blocks of 16, "
             "run_bytes 128 MiB, fan-in 16. Peak RSS: `/usr/bin/time -v` of a process running the pass alone "
             "(read, sign, spill sorted runs, merge, rewrite the directory).", "",
             "| records | stored input MB | applied | gain | spilled runs | merge levels | signing s | sorting s | wall s | µs / record | peak RSS MB | vs first |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['records']:,} | {r['stored_mb']:.0f} | {r['applied']} | {r['gain']:.1%} | {r['runs']} | {r['merge_levels']} | "
                     f"{r['sign_s']:.0f} | {r['sort_s']:.0f} | {r['wall_s']:.0f} | {r['wall_s'] / r['records'] * 1e6:.1f} | "
                     f"{r['max_rss_mb']:.0f} | {r['max_rss_mb'] / base:.3f} |")
    text = "\n".join(lines) + "\n"
    path = Path(args.report) if args.report else REPORTS / "layout_memory.md"
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
