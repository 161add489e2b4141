"""Parquet in -> sharded: the pipeline's read of a Parquet dataset against pyarrow's own, and
its peak memory from 1M to 10M rows.

Writes N synthetic rows (a ~120-character prompt with non-ASCII text, a timestamp, a struct
and a list: the types a dataset carries; no id column, so sharding assigns each row its
number) as Parquet files of ``--file-rows`` rows in row groups of ``--group-rows`` (one file
generated, copied for the rest: the readers do the same work on each), then runs three
passes over the same files, each alone in a child process under ``/usr/bin/time -v`` (its
wall time and maximum resident set size):

- ``arrow``: pyarrow decoding every row group to Arrow batches (``iter_batches``) and
  nothing else: the floor of any reader;
- ``pylist``: the same batches made Python rows (``RecordBatch.to_pylist``): the floor of a
  reader that hands out records, as the pipeline does (only up to ``--floor-max-rows``: it
  is the slow one, and its cost a row does not change with the count);
- ``sharded``: ``storage.reshard`` from the Parquet folder to zstd JSONL shards of 20,000
  records (ids assigned, duplicate check): what the shard step does with a Parquet input
  (the layout pass after it is bench/layout_memory.py's).

    .venv/bin/python bench/parquet_io.py --rows 1000000,10000000

Writes bench/reports/parquet_io.md. Needs ~0.1 GB of disk per million rows under --dir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPORTS = Path(__file__).resolve().parent / "reports"
ROOT = Path(__file__).resolve().parent.parent
PASSES = ("arrow", "pylist", "sharded")
WORDS = "alpha bravo charlie delta écho foxtrot golf hôtel india juliet kilo lima mike 東京 oscar papa".split()


def generate(folder: Path, n: int, file_rows: int, group_rows: int, batch: int = 65_536) -> None:
    """``n`` rows in files of ``file_rows`` (``n`` a multiple of it): the first written a batch at
    a time (the generator stays small), the others copies of it."""
    import datetime as dt

    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("prompt", pa.string()), ("ts", pa.timestamp("us", tz="UTC")),
                        ("meta", pa.struct([("src", pa.string()), ("n", pa.int32())])), ("tags", pa.list_(pa.string()))])
    folder.mkdir(parents=True)
    base = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    if n % file_rows and n > file_rows:
        raise SystemExit(f"--rows {n}: a multiple of --file-rows {file_rows}, please")
    rows_here = min(n, file_rows)
    first = folder / "part-00000.parquet"
    with pq.ParquetWriter(first, schema) as w:
        for start in range(0, rows_here, batch):
            idx = range(start, min(start + batch, rows_here))
            w.write_table(pa.table({
                "prompt": [f"Question {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(14)) for i in idx],
                "ts": pa.array([base + dt.timedelta(seconds=i) for i in idx], pa.timestamp("us", tz="UTC")),
                "meta": [{"src": WORDS[i % len(WORDS)], "n": i % 1000} for i in idx],
                "tags": [[WORDS[i % 5], WORDS[i % 3]] for i in idx],
            }, schema=schema), row_group_size=group_rows)
    for k in range(1, n // rows_here):
        shutil.copyfile(first, folder / f"part-{k:05d}.parquet")


def child(kind: str, src: str, dst: str) -> None:
    """The measured process: one pass."""
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    rows = 0
    if kind in ("arrow", "pylist"):
        for f in sorted(Path(src).glob("*.parquet")):
            pf = pq.ParquetFile(f)
            for b in pf.iter_batches(batch_size=8192, use_threads=False):
                rows += len(b.to_pylist()) if kind == "pylist" else b.num_rows
    else:
        from batch_inference.storage import reshard

        rows = reshard(src, dst, records_per_shard=20_000).records
    print("@@pass " + json.dumps({"rows": rows, "wall_s": time.perf_counter() - t0}), flush=True)


def run_pass(kind: str, src: Path, dst: Path) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, __file__, "--child", kind, str(src), str(dst)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    line = next(x for x in done.stdout.splitlines() if x.startswith("@@pass "))
    return {**json.loads(line[len("@@pass "):]), "max_rss_mb": rss_kb / 1024}


def measure(n: int, root: Path, file_rows: int, group_rows: int, floor_max_rows: int) -> dict:
    src, dst = root / f"in-{n}", root / f"sharded-{n}"
    t0 = time.perf_counter()
    generate(src, n, file_rows, group_rows)
    out: dict = {"rows": n, "generate_s": time.perf_counter() - t0, "files": len(list(src.glob("*.parquet"))),
                 "stored_mb": sum(f.stat().st_size for f in src.glob("*.parquet")) / 2**20}
    for kind in PASSES:
        if kind == "pylist" and n > floor_max_rows:
            continue
        got = run_pass(kind, src, dst)
        if got["rows"] != n:
            raise RuntimeError(f"{kind}: read {got['rows']} rows of {n}")
        out[kind] = got
    out["sharded_mb"] = sum(f.stat().st_size for f in dst.glob("*.zst")) / 2**20
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(dst, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1000000,10000000")
    ap.add_argument("--file-rows", type=int, default=1_000_000, help="rows a Parquet file")
    ap.add_argument("--group-rows", type=int, default=131_072, help="rows a row group")
    ap.add_argument("--floor-max-rows", type=int, default=1_000_000, help="run the pylist pass up to this many rows")
    ap.add_argument("--dir", help="where the data goes (default: a temporary directory)")
    ap.add_argument("--report", help="default bench/reports/parquet_io.md")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    rows: list[dict] = []
    t0, before = time.perf_counter(), round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="parquet-io-", dir=args.dir) as tmp:
        for n in (int(x) for x in args.rows.split(",")):
            rows.append(measure(n, Path(tmp), args.file_rows, args.group_rows, args.floor_max_rows))
            print(json.dumps(rows[-1]), flush=True)
            report(args, rows, t0, before)  # after each size: a long run cut short still reports what it measured


def report(args: argparse.Namespace, rows: list[dict], t0: float, before: float) -> None:
    after = round(os.getloadavg()[0], 2)
    base = rows[0]["sharded"]["max_rss_mb"]
    lines = ["# Parquet in -> sharded, against pyarrow's own read", "",
             f"`{' '.join(sys.argv)}` on {platform.node()} ({os.cpu_count()} CPUs, shared by other work), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.perf_counter() - t0:.0f} s in all; load {before} "
             f"before, {after} after. Synthetic rows (no id column: ids assigned; a ~120-character prompt with non-ASCII words, a UTC timestamp, "
             f"a struct, a list of strings) in files of {args.file_rows:,} rows (one generated, copied), row groups of "
             f"{args.group_rows:,} (snappy, pyarrow's defaults otherwise). Each pass alone in a child process under `/usr/bin/time -v`: "
             "`arrow` decodes every row group to Arrow batches (the floor of any reader), `pylist` also makes them "
             "Python rows (the floor of a reader that hands out records), `sharded` is `storage.reshard` from the "
             "folder to zstd JSONL shards of 20,000 (ids assigned, duplicate check; the shard step's read).", "",
             "| rows | Parquet MB | arrow s | pylist s | sharded s | µs / row sharded | sharded / pylist | sharded / arrow "
             "| peak RSS MB arrow | pylist | sharded | sharded vs first |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def fig(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for r in rows:
        a, s, p = r["arrow"], r["sharded"], r.get("pylist")
        lines.append(f"| {r['rows']:,} | {r['stored_mb']:.0f} | {a['wall_s']:.1f} | {fig(p and p['wall_s'], '.1f')} | "
                     f"{s['wall_s']:.1f} | {s['wall_s'] / r['rows'] * 1e6:.1f} | {fig(p and s['wall_s'] / p['wall_s'], '.2f')} | "
                     f"{s['wall_s'] / a['wall_s']:.1f} | {a['max_rss_mb']:.0f} | {fig(p and p['max_rss_mb'], '.0f')} | "
                     f"{s['max_rss_mb']:.0f} | {s['max_rss_mb'] / base:.3f} |")
    text = "\n".join(lines) + "\n"
    path = Path(args.report) if args.report else REPORTS / "parquet_io.md"
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
