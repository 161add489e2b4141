"""The local result cache's cost per request: a file per entry (the layout before) against
the SQLite store (``pool/result_db.py``), over the same entries.

Each repeat writes ``--entries`` completions into a fresh store (as one batch's chunks do,
``--chunk`` at a time), looks them all up (hits), and looks up as many absent keys (misses),
on each layout, side by side. Reported: CPU seconds (user + system: the kernel's work on
folders and files counts, and it runs on the cores the engine needs) and wall, per phase,
and µs a request. The "file per entry" writer is the earlier ``put_many_sync`` and its lookup
the earlier ``get_many_sync``, kept here as they were, for the comparison.

    .venv/bin/python bench/result_cache_writes.py --entries 5000 --repeats 3

Writes bench/reports/result_cache_writes.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch_inference.engines import Completion  # noqa: E402
from batch_inference.pool.result_cache import ResultCache, _decode, _encode  # noqa: E402

REPORT = Path(__file__).resolve().parent / "reports" / "result_cache_writes.md"


class FilePerEntry:
    """The layout before: ``<k[:2]>/<k[2:4]>/<k>.json``, a temp file and a rename per entry."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _path(self, key: str) -> str:
        return f"{self.root}/{key[:2]}/{key[2:4]}/{key}.json"

    def put_many_sync(self, entries: Mapping[str, Completion]) -> None:
        pid, made = os.getpid(), set()
        for key, c in entries.items():
            path = self._path(key)
            parent, name = path.rsplit("/", 1)
            if parent not in made:
                try:
                    os.mkdir(parent)
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    os.makedirs(parent, exist_ok=True)
                made.add(parent)
            tmp = f"{parent}/.{name}.{pid}.{time.monotonic_ns()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                os.write(fd, _encode(key, c))
            finally:
                os.close(fd)
            os.replace(tmp, path)

    def get_many_sync(self, keys: Sequence[str]) -> dict[str, Completion]:
        found: dict[str, Completion] = {}
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:
                    blob = f.read()
                os.utime(self._path(key))
            except OSError:
                continue
            if (c := _decode(key, blob)) is not None:
                found[key] = c
        return found


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    c0, t0 = cpu_s(), time.perf_counter()
    fn()
    return cpu_s() - c0, time.perf_counter() - t0


def entries(seed: int, n: int) -> dict[str, Completion]:
    return {hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=20).hexdigest():
            Completion(f"answer number {i}: yes", 80, 8, "length") for i in range(n)}


def one_repeat(layout: str, n: int, chunk: int, seed: int) -> dict[str, float]:
    folder = tempfile.mkdtemp(prefix="rc-bench-")
    try:
        store = FilePerEntry(folder) if layout == "file per entry" else ResultCache(folder)
        made = entries(seed, n)
        keys = list(made)
        absent = list(entries(seed + 1_000_000, n))
        parts = [dict(list(made.items())[i:i + chunk]) for i in range(0, n, chunk)]

        def put() -> None:
            for part in parts:
                store.put_many_sync(part)

        def look(ks: list[str]) -> Callable[[], None]:
            def run() -> None:
                for i in range(0, len(ks), chunk):
                    store.get_many_sync(ks[i:i + chunk])
            return run

        put_cpu, put_wall = timed(put)
        hit_cpu, hit_wall = timed(look(keys))
        miss_cpu, miss_wall = timed(look(absent))
        assert len(store.get_many_sync(keys[:chunk])) == min(chunk, n), layout
        return {"put_cpu": put_cpu, "put_wall": put_wall, "hit_cpu": hit_cpu, "hit_wall": hit_wall,
                "miss_cpu": miss_cpu, "miss_wall": miss_wall}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=5000)
    ap.add_argument("--chunk", type=int, default=1000, help="entries a put or lookup takes (a chunk of a task)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", type=Path, default=REPORT)
    a = ap.parse_args()
    layouts = ("file per entry", "SQLite store")
    results: dict[str, list[dict[str, float]]] = {layout: [] for layout in layouts}
    load0 = os.getloadavg()[0]
    for r in range(a.repeats):
        for layout in (layouts if r % 2 == 0 else layouts[::-1]):
            results[layout].append(one_repeat(layout, a.entries, a.chunk, seed=r))
    load1 = os.getloadavg()[0]

    def med(layout: str, key: str) -> float:
        return statistics.median(x[key] for x in results[layout])

    rows = []
    for layout in layouts:
        rows.append(f"| {layout} | " + " | ".join(
            f"{med(layout, f'{phase}_cpu'):.3f} / {med(layout, f'{phase}_wall'):.3f} ({1e6 * med(layout, f'{phase}_cpu') / a.entries:.0f} µs)"
            for phase in ("put", "hit", "miss")) + " |")
    ratio = med("file per entry", "put_cpu") / max(med("SQLite store", "put_cpu"), 1e-9)
    text = f"""# The local result cache's cost per request: a file per entry vs the SQLite store

`bench/result_cache_writes.py --entries {a.entries} --chunk {a.chunk} --repeats {a.repeats}` on {platform.machine()},
{os.cpu_count()} cores, {platform.system()} (a temp folder on the root filesystem); 1-minute load {load0:.2f} at the start,
{load1:.2f} at the end. Each repeat: {a.entries:,} entries written {a.chunk:,} at a time into a fresh store, all looked up
(hits), as many absent keys looked up (misses); the layouts in alternating order.

Median of {a.repeats}: CPU seconds (user + system) / wall seconds (CPU µs a request)

| layout | write | lookup, hits | lookup, misses |
|---|---|---|---|
{chr(10).join(rows)}

Writing costs **{ratio:.0f}x** less CPU in the SQLite store. A file per entry makes a folder and a
file per request and renames it: kernel work on the cores the engine needs (at 10,000 requests/s,
a GPU worker's rate, {med("file per entry", "put_cpu") / a.entries * 1e4:.1f} cores of it).
"""
    print(text)
    a.report.parent.mkdir(parents=True, exist_ok=True)
    a.report.write_text(text)


if __name__ == "__main__":
    main()
