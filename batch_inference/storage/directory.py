"""JsonlDir: a directory of JSONL shards, its manifest and its writers.

Shards list in write order (the manifest's list, else a natural sort of the names).
A directory write replaces the directory: it takes the writer lock (``storage.lock``),
removes the old shards and manifest, commits each shard as it fills and writes the
manifest on a clean exit.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from batch_inference.storage import _io, urls
from batch_inference.storage.file import (
    JsonlFile,
    JsonlWriter,
    OnError,
    QuarantineSink,
    SyncJsonlWriter,
    aiter_records,
    check_sink,
    numbered_records,
    parsed_lines,
    sync_records,
)
from batch_inference.storage.lock import DirLock

Compression = Literal["zstd"] | None

MANIFEST_NAME = "_manifest.json"
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
SHARD_RE = re.compile(r"^[^._].*\.jsonl(\.zst)?$")


def natural_key(name: str) -> tuple:
    """Sort key that orders ``part-99999`` before ``part-100000`` (write order at any count)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


@dataclass
class DirManifest:
    """What a JsonlDir writer committed: read it to count without listing or reading shards."""

    shards: list[dict] = field(default_factory=list)  # [{name, records, bytes, stored_bytes}]
    records: int = 0
    bytes: int = 0
    compression: str | None = None

    def to_json(self) -> bytes:
        return orjson.dumps(
            {"version": 1, "compression": self.compression, "records": self.records, "bytes": self.bytes, "shards": self.shards},
            option=orjson.OPT_INDENT_2,
        )

    @classmethod
    def from_json(cls, data: bytes) -> DirManifest:
        d = orjson.loads(data)
        return cls(shards=d["shards"], records=d["records"], bytes=d["bytes"], compression=d["compression"])


class JsonlDir:
    """A directory of JSONL shards, read in sorted (= write) order."""

    def __init__(self, url: str, *, storage_options: dict | None = None) -> None:
        self.url = urls.normalize(str(url))
        self.storage_options = storage_options
        self.fs, self.path = urls.fs_for(self.url, storage_options)

    def __repr__(self) -> str:
        return f"JsonlDir({self.url!r})"

    def shard_url(self, index: int, compression: Compression = "zstd", prefix: str = "part") -> str:
        """URL of shard ``index``: ``.../part-00007.jsonl.zst`` (5 digits, wider past 99,999)."""
        return urls.join(self.url, f"{prefix}-{index:05d}.jsonl" + (".zst" if compression == "zstd" else ""))

    def _file(self, name: str) -> JsonlFile:
        return JsonlFile(urls.join(self.url, name), storage_options=self.storage_options)

    # listing -------------------------------------------------------------

    def manifest(self) -> DirManifest | None:
        """The committed manifest, or None (directory written shard by shard, or being rewritten)."""
        path = f"{self.path}/{MANIFEST_NAME}"
        self.fs.invalidate_cache(path)  # rewritten by another process since we last looked?
        try:
            with self.fs.open(path, "rb") as f:
                return DirManifest.from_json(f.read())
        except FileNotFoundError:
            return None

    def _listed_names(self) -> list[str]:
        self.fs.invalidate_cache(self.path)
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            raise FileNotFoundError(f"No such directory: {self.url}") from None
        names = [urls.basename(e) for e in entries]
        if not names and not self.fs.isdir(self.path):
            raise FileNotFoundError(f"No such directory: {self.url}")
        return names

    def shards(self) -> list[JsonlFile]:
        """Committed shards in write order: the manifest's list, else a sorted listing.

        Hidden (``.``) and underscore names are never shards: temp files and metadata.
        """
        man = self.manifest()
        if man is not None:
            return [self._file(s["name"]) for s in man.shards]
        names = [n for n in self._listed_names() if SHARD_RE.match(n)]
        return [self._file(n) for n in sorted(names, key=natural_key)]

    def count_records(self) -> int:
        """From the manifest when present, else by streaming every shard."""
        man = self.manifest()
        if man is not None:
            return man.records
        return sum(1 for _ in self.iter_records_sync())

    def exists_sync(self) -> bool:
        self.fs.invalidate_cache(self.path)
        return bool(self.fs.exists(self.path))

    # reading -------------------------------------------------------------

    def iter_records_sync(
        self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None
    ) -> Iterator[dict]:
        return sync_records(self.shards, on_error, quarantine)

    def iter_numbered_sync(
        self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None
    ) -> Iterator[tuple[int, dict]]:
        """``(line number, record)``: 0-based over the shards in order, blank and malformed lines counted."""
        return numbered_records(self.shards, on_error, quarantine)

    def iter_parsed_lines_sync(self) -> Iterator[tuple[dict, bytes]]:
        """``(record, its line)`` over the shards in order (``file.parsed_lines``)."""
        return parsed_lines(self.shards)

    def iter_records(
        self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None
    ) -> AsyncIterator[dict]:
        check_sink(on_error, quarantine)
        return aiter_records(self.shards, on_error, quarantine)

    # writing -------------------------------------------------------------

    def _core(
        self, max_records_per_shard: int | None, max_bytes_per_shard: int, compression: Compression,
        prefix: str, zstd_level: int, on_shard: Callable[[_io.ShardStats], None] | None = None,
    ) -> _DirSession:
        if compression not in ("zstd", None):
            raise ValueError(f"compression must be 'zstd' or None, not {compression!r}")
        return _DirSession(self, max_records_per_shard, max_bytes_per_shard, compression, prefix, zstd_level, on_shard)

    def writer(
        self,
        *,
        max_records_per_shard: int | None = None,
        max_bytes_per_shard: int = DEFAULT_MAX_BYTES,
        compression: Compression = None,
        prefix: str = "part",
        zstd_level: int = _io.DEFAULT_ZSTD_LEVEL,
    ) -> JsonlDirWriter:
        """Async writer that rotates shards at whichever limit comes first.

        Shards are plain ``part-NNNNN.jsonl`` by default, as the reference design's
        ``JsonlDir`` writes them; ``compression="zstd"`` writes ``.jsonl.zst`` (what the
        pipeline uses for every directory it writes).

        The directory is rewritten whole: on entry the previous shards and manifest are
        removed; each shard commits atomically as it fills; a clean exit writes the
        manifest; an exception removes this writer's shards. A second concurrent writer
        of the same directory gets ``ConcurrentWriteError``.
        """
        return JsonlDirWriter(self._core(max_records_per_shard, max_bytes_per_shard, compression, prefix, zstd_level))

    def writer_sync(
        self,
        *,
        max_records_per_shard: int | None = None,
        max_bytes_per_shard: int = DEFAULT_MAX_BYTES,
        compression: Compression = None,
        prefix: str = "part",
        zstd_level: int = _io.DEFAULT_ZSTD_LEVEL,
        on_shard: Callable[[_io.ShardStats], None] | None = None,
    ) -> SyncJsonlDirWriter:
        """The blocking writer (as ``writer``); ``on_shard(stats)`` is told about each shard as it
        commits, on the writing thread: readable from then on, before the manifest (a reader that
        starts on shards early, as round 0 beside the layout pass does)."""
        return SyncJsonlDirWriter(self._core(max_records_per_shard, max_bytes_per_shard, compression, prefix, zstd_level, on_shard))


class _DirSession:
    """Blocking lifecycle of one directory write: lock, clear, rotate, manifest, unlock."""

    def __init__(
        self, d: JsonlDir, max_records: int | None, max_bytes: int, compression: Compression, prefix: str, level: int,
        on_shard: Callable[[_io.ShardStats], None] | None = None,
    ) -> None:
        self.dir = d
        self.compression = compression
        self.lock = DirLock(d.fs, d.path, d.url)
        self.core = _io.RotatingWriter(
            d.fs,
            lambda i: f"{d.path}/{urls.basename(d.shard_url(i, compression, prefix))}",
            compressed=compression == "zstd",
            max_records=max_records,
            max_bytes=max_bytes,
            zstd_level=level,
            on_commit=on_shard,
            on_block=self.lock.heartbeat,
        )

    def open(self) -> None:
        self.lock.acquire()
        try:
            fs, path = self.dir.fs, self.dir.path
            fs.invalidate_cache(path)
            stale = [e for e in fs.ls(path, detail=False) if SHARD_RE.match(urls.basename(e)) or urls.basename(e) == MANIFEST_NAME]
            if stale:
                fs.rm(sorted(stale, key=lambda e: urls.basename(e) != MANIFEST_NAME))  # manifest first
        except BaseException:
            self.lock.release()
            raise

    def commit(self) -> None:
        try:
            self.core.close()
            self.lock.verify()
            c = self.core
            man = DirManifest(shards=list(c.committed), records=c.records, bytes=c.bytes, compression=self.compression)
            manifest = _io.AtomicFile(self.dir.fs, f"{self.dir.path}/{MANIFEST_NAME}")
            manifest.write(man.to_json())
            manifest.commit()
        finally:
            self.lock.release()

    def abort(self) -> None:
        self.core.abort()
        if self.lock.taken_over():
            return  # another writer took the directory over: its shards carry our names, leave them
        try:
            paths = [self.core.path_for(i) for i in range(self.core.index)]
            if paths:
                self.dir.fs.rm(paths)
        finally:
            self.lock.release()


class _DirWriterBase:
    def __init__(self, session: _DirSession) -> None:
        self._s = session
        self._w: Any = None

    @property
    def url(self) -> str:
        return self._s.dir.url

    @property
    def records(self) -> int:
        return self._w.records if self._w else 0

    @property
    def shards_written(self) -> int:
        return len(self._s.core.committed)

    def manifest(self) -> DirManifest:
        c = self._s.core
        return DirManifest(shards=list(c.committed), records=c.records, bytes=c.bytes, compression=self._s.compression)


class SyncJsonlDirWriter(_DirWriterBase):
    def __enter__(self) -> SyncJsonlDirWriter:
        self._s.open()
        self._w = SyncJsonlWriter(self._s.core, self.url)
        self.write = self._w.write  # bound directly: no extra call per record
        self.write_many = self._w.write_many
        self.write_lines = self._w.write_lines
        self.cut = self._w.cut
        return self

    def write(self, rec: dict) -> None:
        raise RuntimeError("use the writer inside its `with` block")

    def write_lines(self, lines: Iterable[bytes]) -> None:
        raise RuntimeError("use the writer inside its `with` block")

    def cut(self) -> None:
        """End the current shard here; the next record starts a new one (the size limits still apply)."""
        raise RuntimeError("use the writer inside its `with` block")

    def write_many(self, recs: Iterable[dict]) -> None:
        raise RuntimeError("use the writer inside its `with` block")

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self._w._drain()
                self._s.commit()
                return
            except BaseException:
                self._s.abort()
                raise
        self._w._closed = True
        self._s.abort()


class JsonlDirWriter(_DirWriterBase):
    async def __aenter__(self) -> JsonlDirWriter:
        await asyncio.to_thread(self._s.open)
        self._w = JsonlWriter(self._s.core, self.url)
        self.write = self._w.write  # bound directly: one coroutine per record, not two
        self.write_many = self._w.write_many
        return self

    async def write(self, rec: dict) -> None:
        raise RuntimeError("use the writer inside its `async with` block")

    async def write_many(self, recs: Iterable[dict]) -> None:
        raise RuntimeError("use the writer inside its `async with` block")

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        w = self._w
        if exc_type is None:
            try:
                await w._drain()
                await w._run(self._s.commit)  # on the writer's thread, after the block in flight
                w._release()
                return
            except BaseException:
                await w.abort()
                await asyncio.to_thread(self._s.abort)
                raise
        await w.abort()
        await asyncio.to_thread(self._s.abort)
