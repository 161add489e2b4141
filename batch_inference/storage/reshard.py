"""reshard: stream one JSONL file (or a JsonlDir, or Parquet) into a JsonlDir of even shards, in constant memory.

Also the place where records get their stable ``id``: a record without one gets
``f"{line:012d}"``, the 0-based number of its line in the source (blank and malformed
lines counted, so the id names the line the quarantine's 1-based ``line`` would: id
``000000000004`` is line 5). Duplicate ids are found exactly with a set while the input
is small, past ``EXACT_IDS`` with a fixed-size Bloom filter (memory independent of the
dataset), and confirmed exactly by a second pass over only the suspects.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from batch_inference.storage.directory import DEFAULT_MAX_BYTES, Compression, JsonlDir
from batch_inference.storage.file import JsonlFile, OnError, QuarantineSink
from batch_inference.storage.parquet import ParquetSource
from batch_inference.storage.sources import open_source

MALFORMED_EXAMPLES = 5  # malformed lines a report names by file and line
BLOOM_BYTES = 64 * 1024 * 1024  # 512 Mi bits: ~0.1% false suspects at 100M ids (k=4)
# Ids held exactly before the Bloom filter takes over (~20 MB of short strings): a small
# input neither allocates and zeroes the filter's 64 MiB (~25 ms, every shard step) nor
# hashes each id with blake2b.
EXACT_IDS = 200_000


class _Bloom:
    """k=4 Bloom filter over a bytearray; ``add`` returns True when the id was possibly seen."""

    def __init__(self, nbytes: int) -> None:
        self.bits = bytearray(nbytes)
        self.m = nbytes * 8

    def add(self, key: str) -> bool:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little")
        h1, h2 = h & 0xFFFFFFFFFFFFFFFF, (h >> 64) | 1
        bits, m, seen = self.bits, self.m, True
        for i in range(4):
            pos = (h1 + i * h2) % m
            byte, bit = pos >> 3, 1 << (pos & 7)
            if not bits[byte] & bit:
                seen = False
                bits[byte] |= bit
        return seen


class _SeenIds:
    """The ids met so far: a set up to ``exact`` of them, then a Bloom filter of ``nbytes``
    (the set's members moved into it); ``add`` returns True when the id was possibly seen."""

    def __init__(self, nbytes: int, exact: int = EXACT_IDS) -> None:
        self.nbytes, self.exact = nbytes, exact
        self.ids: set[str] | None = set()
        self.bloom: _Bloom | None = None

    def add(self, key: str) -> bool:
        if self.ids is None:
            return self.bloom.add(key)  # type: ignore[union-attr]
        if key in self.ids:
            return True
        if len(self.ids) < self.exact:
            self.ids.add(key)
            return False
        self.bloom = _Bloom(self.nbytes)
        for seen in self.ids:
            self.bloom.add(seen)
        self.ids = None
        return self.bloom.add(key)


@dataclass
class ReshardReport:
    records: int = 0
    shards: int = 0
    bytes: int = 0
    ids_assigned: int = 0
    duplicate_ids: dict[str, int] = field(default_factory=dict)  # id -> occurrences (>1)
    malformed: int = 0  # lines handed to the quarantine sink (on_error="quarantine")
    malformed_lines: list[dict[str, Any]] = field(default_factory=list)  # {file, line} of the first few

    def count_malformed(self, entry: Mapping[str, Any]) -> None:
        """One more malformed line (a quarantine entry); the first few are kept by file and line."""
        self.malformed += 1
        if len(self.malformed_lines) < MALFORMED_EXAMPLES:
            self.malformed_lines.append({"file": entry["file"], "line": entry["line"]})


class RefusedRecord(ValueError):
    """Raised by a ``reshard`` transform for a record that cannot run (no id under the spec's
    ``id_field``): the record is quarantined like a malformed line, named by file and line."""


def locate(source: Source, pos: int) -> tuple[str, int]:
    """``(file, 1-based line or row in it)`` of the record at ``pos`` (0-based across the source,
    as ``iter_numbered_sync`` numbers it). A folder of JSONL shards numbers its lines across its
    files: the folder and that number are named."""
    if isinstance(source, ParquetSource):
        for file, rows in zip(source.files, source.rows_by_file):
            if pos < rows:
                return file, pos + 1
            pos -= rows
    return source.url, pos + 1


def assigned_id(pos: int) -> str:
    """The id of a record that has none: its 0-based position in the source, zero-padded."""
    return f"{pos:012d}"


Source = JsonlFile | JsonlDir | ParquetSource


def _source(src: str | Source, storage_options: dict | None) -> Source:
    """The reader of ``src`` (``sources.open_source``: a folder of no known format is refused)."""
    if isinstance(src, str):
        return open_source(src, storage_options)
    return src


def reshard(
    src: str | Source,
    dst: str | JsonlDir,
    *,
    records_per_shard: int | None,
    max_bytes_per_shard: int = DEFAULT_MAX_BYTES,
    compression: Compression = "zstd",
    assign_ids: bool = True,
    check_duplicates: bool = True,
    storage_options: dict | None = None,
    bloom_bytes: int = BLOOM_BYTES,
    exact_ids: int = EXACT_IDS,
    on_error: OnError = "raise",
    quarantine: QuarantineSink | None = None,
    transform: Callable[[dict, int], dict] | None = None,
) -> ReshardReport:
    """Blocking: rewrite ``src`` into ``dst`` (replaced whole) and report counts and duplicate ids.

    Run it with ``asyncio.to_thread`` from async code; it is a CPU pass. With
    ``on_error="quarantine"`` malformed lines go to the (synchronous) ``quarantine`` sink
    and the rest is resharded. ``transform(record, line)`` rewrites each record (``line``:
    0-based, as ids are assigned) before ids are assigned (e.g. an input format converted
    to native records); one that raises ``RefusedRecord`` leaves that record out, quarantined
    (``on_error="quarantine"``, named by file and line) or raised.
    """
    source = _source(src, storage_options)
    out = dst if isinstance(dst, JsonlDir) else JsonlDir(dst, storage_options=storage_options)
    report = ReshardReport()
    seen = _SeenIds(bloom_bytes, exact_ids) if check_duplicates else None
    suspects: set[str] = set()

    last_pos = -1  # the position of the last record read: a quarantined line's place in the input's order

    def counted(entry: dict) -> None:
        report.count_malformed(entry)
        quarantine({**entry, "follows": last_pos})  # type: ignore[misc]

    with out.writer_sync(
        max_records_per_shard=records_per_shard, max_bytes_per_shard=max_bytes_per_shard, compression=compression
    ) as w:
        for pos, rec in source.iter_numbered_sync(on_error=on_error, quarantine=counted):
            last_pos = pos
            if transform is not None:
                try:
                    rec = transform(rec, pos)
                except RefusedRecord as exc:
                    file, line = locate(source, pos)
                    if on_error != "quarantine":
                        raise RefusedRecord(f"{file}:{line}: {exc}") from None
                    counted({"file": file, "line": line, "reason": str(exc), "raw": ""})
                    continue
            rid = rec.get("id")
            if rid is None and assign_ids:
                rid = rec["id"] = assigned_id(pos)
                report.ids_assigned += 1
            if seen is not None and rid is not None and seen.add(str(rid)):
                suspects.add(str(rid))
            w.write(rec)
        report.records = w.records
    man = out.manifest()
    report.shards = len(man.shards) if man else 0
    report.bytes = man.bytes if man else 0
    if suspects:  # confirm exactly: count only the suspects over the output
        counts = Counter(str(r.get("id")) for r in out.iter_records_sync() if str(r.get("id")) in suspects)
        report.duplicate_ids = {k: v for k, v in sorted(counts.items()) if v > 1}
    return report
