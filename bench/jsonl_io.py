"""Benchmark: JsonlDir write/read throughput against a no-abstraction floor, same run, same data.

    .venv/bin/python bench/jsonl_io.py [--records 1000000] [--level 3]

Writes N records of ~200 bytes as 20,000-record shards on local disk, plain and zstd,
with (a) the floor: orjson + zstandard straight to files, 1 MiB buffers; (b) ours:
``JsonlDir.writer`` / ``iter_records`` (async, the worker's path) and the sync reader;
(c) flyteplugins-jsonl's JsonlDir when importable (run with the throwaway venv:
``PYTHONPATH=. /tmp/flyte-jsonl-venv/bin/python bench/jsonl_io.py``). Prints records/s,
MB/s, ratio to the floor (target >= 0.8) and peak RSS; writes bench/reports/jsonl_io.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batch_inference.storage import JsonlDir  # noqa: E402
from batch_inference.storage import _io  # noqa: E402

SHARD = 20_000
BUF = 1 << 20


def make_records(n: int) -> list[dict]:
    """~200-byte records with realistic entropy (seeded words from a 2,000-word vocabulary)."""
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(2000)]
    return [
        {
            "id": f"{i:012d}",
            "prompt": " ".join(rng.choices(vocab, k=18)),
            "n": i,
            "score": round(rng.random(), 6),
            "tags": ["a", "b"] if i % 3 else ["c"],
        }
        for i in range(n)
    ]


# ----------------------------------------------------------------- floor


def floor_write(recs: list[dict], out: Path, zstd: bool, level: int) -> None:
    out.mkdir(parents=True)
    dumps, opt = orjson.dumps, orjson.OPT_APPEND_NEWLINE
    cctx = zstandard.ZstdCompressor(level=level)
    for s in range(0, len(recs), SHARD):
        path = out / f"part-{s // SHARD:05d}.jsonl{'.zst' if zstd else ''}"
        with open(path, "wb") as f:
            cobj = cctx.compressobj() if zstd else None
            buf: list[bytes] = []
            size = 0
            for r in recs[s : s + SHARD]:
                line = dumps(r, option=opt)
                buf.append(line)
                size += len(line)
                if size >= BUF:
                    data = b"".join(buf)
                    f.write(cobj.compress(data) if cobj else data)
                    buf, size = [], 0
            data = b"".join(buf)
            f.write(cobj.compress(data) if cobj else data)
            if cobj:
                f.write(cobj.flush())


def floor_read(out: Path, zstd: bool) -> int:
    n = 0
    loads = orjson.loads
    for path in sorted(out.iterdir()):
        with open(path, "rb", buffering=BUF) as raw:  # the same 1 MiB reads as ours (default: 8 KB)
            f = zstandard.ZstdDecompressor().stream_reader(raw, read_size=BUF) if zstd else raw
            for line in io.BufferedReader(f, BUF) if zstd else f:
                loads(line)
                n += 1
    return n


async def floor_read_async(out: Path, zstd: bool) -> int:
    """The floor's read loop behind an async generator (blocking: it only prices the `async for`)."""

    async def records():
        loads = orjson.loads
        for path in sorted(out.iterdir()):
            with open(path, "rb", buffering=BUF) as raw:
                f = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_size=BUF), BUF) if zstd else raw
                for line in f:
                    yield loads(line)

    n = 0
    async for _ in records():
        n += 1
    return n


# ----------------------------------------------------------------- ours


async def ours_write(recs: list[dict], out: Path, zstd: bool, level: int) -> None:
    async with JsonlDir(str(out)).writer(
        max_records_per_shard=SHARD, compression="zstd" if zstd else None, zstd_level=level
    ) as w:
        for r in recs:
            await w.write(r)


async def ours_write_many(recs: list[dict], out: Path, zstd: bool, level: int) -> None:
    async with JsonlDir(str(out)).writer(
        max_records_per_shard=SHARD, compression="zstd" if zstd else None, zstd_level=level
    ) as w:
        for s in range(0, len(recs), 2000):  # the shard tasks' chunk size
            await w.write_many(recs[s : s + 2000])


async def ours_read_async(out: Path) -> int:
    n = 0
    async for _ in JsonlDir(str(out)).iter_records():
        n += 1
    return n


def ours_read_sync(out: Path) -> int:
    n = 0
    for _ in JsonlDir(str(out)).iter_records_sync():
        n += 1
    return n


# ----------------------------------------------------------------- flyte


def flyte_available() -> bool:
    try:
        import flyteplugins.jsonl  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not measured"
        return False
    return True


async def flyte_write(recs: list[dict], out: Path, zstd: bool, level: int) -> None:
    from flyteplugins.jsonl import JsonlDir as FJsonlDir

    ext = ".jsonl.zst" if zstd else ".jsonl"
    out.mkdir(parents=True)  # its local writer does not create the directory
    async with FJsonlDir(path=str(out)).writer(shard_extension=ext, max_records_per_shard=SHARD, compression_level=level) as w:
        for r in recs:
            await w.write(r)


async def flyte_read(out: Path) -> int:
    from flyteplugins.jsonl import JsonlDir as FJsonlDir

    n = 0
    async for _ in FJsonlDir(path=str(out)).iter_records():
        n += 1
    return n


# ----------------------------------------------------------------- harness


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--level", type=int, default=_io.DEFAULT_ZSTD_LEVEL, help="zstd level (ours and the floor)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N interleaved rounds")
    ap.add_argument("--report", default=str(Path(__file__).parent / "reports" / "jsonl_io.md"))
    args = ap.parse_args()

    load_before = os.getloadavg()
    recs = make_records(args.records)
    raw_mb = sum(len(orjson.dumps(r)) + 1 for r in recs) / 1e6
    has_flyte = flyte_available()
    best: dict[tuple[str, str, str], float] = {}  # (case, impl, op) -> best seconds
    tmp = Path(tempfile.mkdtemp(prefix="jsonl_io_"))

    def measure(case: str, name: str, op: str, fn: Callable[[], object], expect: int | None = None) -> None:
        result: list[object] = []
        t = timed(lambda: result.append(fn()))
        if expect is not None:
            assert result[0] == expect, f"{name} read {result[0]} records, wrote {expect}"
        best[(case, name, op)] = min(best.get((case, name, op), float("inf")), t)

    try:
        for zstd in (False, True):
            case = f"zstd-{args.level}" if zstd else "plain"
            # Interleaved rounds: every implementation runs once per round, best of N
            # rounds, so load from other processes hits all of them alike.
            for k in range(args.repeat):
                d = {name: tmp / f"{case}-{name}-{k}" for name in ("floor", "many", "each", "flyte")}
                n = args.records
                writes = [
                    ("floor", lambda: floor_write(recs, d["floor"], zstd, args.level)),
                    ("ours (async, write_many)", lambda: asyncio.run(ours_write_many(recs, d["many"], zstd, args.level))),
                    ("ours (async, await write per record)", lambda: asyncio.run(ours_write(recs, d["each"], zstd, args.level))),
                ]
                for name, fn in writes[k % 3 :] + writes[: k % 3]:  # rotate who goes first
                    os.sync()  # start each write with no dirty pages left by the previous one
                    measure(case, name, "write", fn)
                measure(case, "floor", "read", lambda: floor_read(d["floor"], zstd), n)
                measure(case, "floor behind an async generator", "read", lambda: asyncio.run(floor_read_async(d["floor"], zstd)), n)
                measure(case, "ours (async)", "read", lambda: asyncio.run(ours_read_async(d["many"])), n)
                measure(case, "ours (sync)", "read", lambda: ours_read_sync(d["many"]), n)
                if has_flyte:
                    os.sync()
                    measure(case, "flyteplugins-jsonl", "write", lambda: asyncio.run(flyte_write(recs, d["flyte"], zstd, args.level)))
                    measure(case, "flyteplugins-jsonl", "read", lambda: asyncio.run(flyte_read(d["flyte"])), n)
                if zstd and k == 0:
                    print(f"  zstd-{args.level} stored size: {dir_bytes(d['many']) / 1e6:.1f} MB of {raw_mb:.1f} MB raw")
                for p in d.values():
                    shutil.rmtree(p, ignore_errors=True)
            print(f"  {case} done")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    load_after = os.getloadavg()
    rows = [(c, name, op, t) for (c, name, op), t in best.items()]
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    floor = {(c, op): t for c, name, op, t in rows if name == "floor"}
    lines = [
        "# JsonlDir I/O benchmark",
        "",
        f"{args.records:,} records, {raw_mb / args.records * 1e6:.0f} B each ({raw_mb:.0f} MB raw), "
        f"{SHARD:,} records per shard, local disk, zstd level {args.level}, best of {args.repeat} interleaved rounds. "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs (shared; load average "
        f"{load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end). "
        f"flyteplugins-jsonl: {'measured' if has_flyte else 'not installed'}.",
        "",
        "| case | impl | op | records/s | MB/s | ratio to floor |",
        "|---|---|---|---:|---:|---:|",
    ]
    for case, name, op, t in rows:
        ratio = floor[(case, op)] / t
        lines.append(f"| {case} | {name} | {op} | {args.records / t:,.0f} | {raw_mb / t:,.1f} | {ratio:.2f} |")
    afloor = {c: t for c, name, op, t in rows if name.startswith("floor behind")}
    ours = {(c, name, op): floor[(c, op)] / t for c, name, op, t in rows if name.startswith("ours")}
    async_read = {c: afloor[c] / t for c, name, op, t in rows if name == "ours (async)" and op == "read"}
    lines += [
        "",
        "Ratios of ours to the floor: "
        + ", ".join(f"{c} {name} {op} {r:.2f}" for (c, name, op), r in ours.items())
        + " (target >= 0.80).",
        "Async read against the floor behind an async generator (the same `async for` protocol cost): "
        + ", ".join(f"{c} {r:.2f}" for c, r in async_read.items())
        + ".",
        f"Peak RSS: {peak_rss_mb:,.0f} MB (includes the {args.records:,} records held in memory as the input).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(text)
    print(f"report written to {args.report}")


if __name__ == "__main__":
    main()
