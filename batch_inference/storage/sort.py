"""External sort of encoded JSONL records by a byte key, in memory bounded by a run's size.

``ExternalSort`` takes ``(key, line)`` pairs (``line``: one JSON object ending in a
newline), gathers them up to ``run_bytes``, sorts each run in memory and spills it
through the storage layer (a zstd file under ``spill_url``, its lines
``{"k": "<hex key>", "r": <record>}``). ``finish()`` then merges the runs ``fan_in`` at
a time until at most ``fan_in`` are left (spilling the intermediate merges), and
``iter_sorted()`` yields the records in key order (as often as asked: one merge each). Keys compare as bytes; ties keep the order they were added in
(each run's sort and every merge are stable), so the same input always sorts the same.

Memory is one run while adding and ``fan_in`` open readers (a block of ``MERGE_BLOCK_BYTES``
each) while merging, whatever the number of records; the spill takes about the records' compressed
size (twice while one merge level is written). A sort whose process dies leaves its
spill files: ``clear()`` (which ``__enter__`` calls) removes them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from batch_inference.storage import _io, urls

DEFAULT_RUN_BYTES = 128 << 20
DEFAULT_FAN_IN = 16
MERGE_BLOCK_BYTES = 1 << 17  # lines read at a time from each run being merged: fan_in of them are open
_ITEM_OVERHEAD = 120  # bytes a (key, line) pair costs beyond its contents (tuple, two bytes objects)
_HEAD = b'{"k":"'
_MID = b'","r":'


def _spill_line(hex_key: bytes, line: bytes) -> bytes:
    return b"".join((_HEAD, hex_key, _MID, line[:-1] if line.endswith(b"\n") else line, b"}\n"))


def _parse(line: bytes) -> tuple[bytes, bytes]:
    """(hex key, record line) of a spill line, by slicing (no JSON parse)."""
    end = line.index(b'"', len(_HEAD))
    return line[len(_HEAD):end], line[end + len(_MID):line.rindex(b"}")] + b"\n"


class ExternalSort:
    """Sort records by key through spill files; ``with ExternalSort(url) as s: s.add(k, line) ...``."""

    def __init__(self, spill_url: str, *, storage_options: dict | None = None, run_bytes: int = DEFAULT_RUN_BYTES,
                 fan_in: int = DEFAULT_FAN_IN, zstd_level: int = 1, name: str = "") -> None:
        if run_bytes < 1 or fan_in < 2:
            raise ValueError(f"run_bytes must be >= 1 and fan_in >= 2, got {run_bytes}, {fan_in}")
        self.url = urls.normalize(spill_url)
        self.storage_options = storage_options
        self.fs, self.path = urls.fs_for(self.url, storage_options)
        self.run_bytes, self.fan_in, self.zstd_level = run_bytes, fan_in, zstd_level
        self.name = name  # spill files' name prefix: sorts of other processes spilling into one folder stay apart
        self._items: list[tuple[bytes, bytes]] = []
        self._bytes = 0
        self._names = itertools.count()
        self.runs: list[str] = []  # spill paths of the runs not merged yet, in the order they were added
        self.records = 0
        self.spilled_runs = 0
        self.merge_levels = 0
        self._finished = False

    def __enter__(self) -> ExternalSort:
        self.clear()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.clear()

    def clear(self) -> None:
        """Remove every spill file under ``spill_url`` (this sort's, or a dead one's)."""
        self._items, self._bytes, self.runs = [], 0, []
        self.fs.invalidate_cache(self.path)
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)

    def add(self, key: bytes, line: bytes) -> None:
        if self._finished:
            raise RuntimeError("ExternalSort.add() after finish()")
        self._items.append((key, line))
        self._bytes += len(key) + len(line) + _ITEM_OVERHEAD
        self.records += 1
        if self._bytes >= self.run_bytes:
            self.spill()

    def _new_path(self, kind: str) -> str:
        return f"{self.path}/{self.name}{kind}-{next(self._names):06d}.jsonl.zst"

    def _write(self, path: str, lines: Iterator[bytes]) -> None:
        core = _io.RotatingWriter(self.fs, lambda _i: path, compressed=True, zstd_level=self.zstd_level, always_create=True)
        try:
            buf: list[bytes] = []
            size = 0
            for line in lines:
                buf.append(line)
                size += len(line)
                if size >= _io.WRITE_BUFFER:
                    core.write_lines(buf, size)
                    buf, size = [], 0
            core.write_lines(buf, size)
            core.close()
        except BaseException:
            core.abort()
            raise

    def spill(self) -> None:
        """Write the records held in memory as one sorted run (what ``add`` does when ``run_bytes`` fill)."""
        if not self._items:
            return
        items, self._items, self._bytes = self._items, [], 0
        items.sort(key=lambda kv: kv[0])  # stable: equal keys keep the order they came in
        path = self._new_path("run")
        self._write(path, (_spill_line(k.hex().encode(), line) for k, line in items))
        del items
        self.runs.append(path)
        self.spilled_runs += 1

    def spill_runs(self) -> list[str]:
        """No more records: spill what is in memory as a last run and return every run's
        path, sorted each, unmerged, in the order added (for another process's sort to
        ``adopt``). Nothing is removed: the adopting sort's ``clear`` does that."""
        if self._finished:
            raise RuntimeError("ExternalSort.spill_runs() after finish()")
        self.spill()
        self._finished = True
        return list(self.runs)

    def adopt(self, runs: list[str], records: int = 0) -> None:
        """Take sorted runs another sort spilled into this sort's folder (``spill_runs``),
        after the runs taken so far: on equal keys their records come after those already
        taken, so adopting each part of the input in order sorts as adding them would."""
        if self._finished:
            raise RuntimeError("ExternalSort.adopt() after finish()")
        if self._items:
            raise RuntimeError("ExternalSort.adopt() after add(): the order of equal keys would be lost")
        prefix = f"{self.path}/"
        for path in runs:
            if not path.startswith(prefix) or "/" in path[len(prefix):]:
                raise ValueError(f"ExternalSort.adopt(): {path} is not a run in {self.url}")
        self.runs.extend(runs)
        self.spilled_runs += len(runs)
        self.records += records

    def _read(self, path: str) -> Iterator[tuple[bytes, bytes]]:
        url = f"{self.url.rstrip('/')}/{path.rsplit('/', 1)[-1]}"
        for _url, _first, lines in _io.iter_blocks(self.fs, path, url, True, MERGE_BLOCK_BYTES):
            for line in lines:
                yield _parse(line)

    def _merged(self, paths: list[str]) -> Iterator[tuple[bytes, bytes]]:
        # heapq.merge is stable: equal keys come from earlier runs first (the order added)
        return heapq.merge(*(self._read(p) for p in paths), key=lambda kv: kv[0])

    def finish(self, pool: Executor | None = None) -> None:
        """No more records: sort what is in memory, or spill it and merge the runs down to
        at most ``fan_in`` (intermediate merges are spilled too). ``pool``: a process pool
        that merges each level's groups side by side (``merge_group``); the result is the same."""
        if self._finished:
            return
        self._finished = True
        if not self.runs:  # everything fits in one run: it stays in memory, no spill at all
            self._items.sort(key=lambda kv: kv[0])
            return
        self.spill()
        while len(self.runs) > self.fan_in:
            self.merge_levels += 1
            merged: list[str] = []
            jobs: list[MergeJob] = []
            for i in range(0, len(self.runs), self.fan_in):
                group = self.runs[i:i + self.fan_in]
                if len(group) == 1:
                    merged.append(group[0])
                    continue
                merged.append(self._new_path("merge"))
                jobs.append(MergeJob(self.url, self.storage_options, tuple(group), merged[-1], self.zstd_level))
            for _ in (pool.map(merge_group, jobs) if pool is not None else map(merge_group, jobs)):
                pass
            self.runs = merged

    def iter_sorted(self) -> Iterator[tuple[bytes, bytes]]:
        """``(key, line)`` of every record added, in key order (ties in the order added).

        Call ``finish()`` first; each call reads the sorted records again.
        """
        if not self._finished:
            raise RuntimeError("ExternalSort.iter_sorted() before finish()")
        if not self.runs:
            yield from self._items
            return
        for hex_key, line in self._merged(self.runs):
            yield bytes.fromhex(hex_key.decode()), line

    def sorted_lines(self) -> Iterator[bytes]:
        """Every record added, in key order (``finish()`` is called)."""
        self.finish()
        for _, line in self.iter_sorted():
            yield line


@dataclass(frozen=True)
class MergeJob:
    """One group of an intermediate merge level: its runs (in order) into one run at ``path``."""

    url: str
    storage_options: dict | None
    runs: tuple[str, ...]
    path: str
    zstd_level: int


def merge_group(job: MergeJob) -> str:
    """Merge a group's runs into one run and remove them (in this process or a worker's)."""
    s = ExternalSort(job.url, storage_options=job.storage_options, zstd_level=job.zstd_level)
    s._write(job.path, (_spill_line(k, line) for k, line in s._merged(list(job.runs))))
    s.fs.rm(list(job.runs))
    return job.path
