"""Blocking byte-level I/O under JsonlFile/JsonlDir: chunked reads, line parsing, atomic writes.

Everything here is synchronous on purpose: the async API runs these functions in a
thread, one *block* (hundreds of records) per hop, never one record per hop.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import orjson
import zstandard

from batch_inference.storage import urls
from batch_inference.storage.errors import CorruptShardError, MalformedRecordError

PLAIN_READ_SIZE = 1 << 20  # raw bytes per read of a plain shard
ZSTD_READ_SIZE = 1 << 16  # compressed bytes fed to the decompressor per step (64 KB class)
WRITE_BUFFER = 1 << 20  # uncompressed bytes gathered before one compress + write
DEFAULT_ZSTD_LEVEL = 3

Quarantined = dict[str, Any]  # {file, line, reason, raw}


# ---------------------------------------------------------------- reading


def iter_chunks(fs: fsspec.AbstractFileSystem, path: str, url: str, compressed: bool) -> Iterator[bytes]:
    """Yield the (decompressed) bytes of a file in bounded chunks."""
    try:
        f = fs.open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"No such file: {url}") from None
    with f:
        if not compressed:
            while chunk := f.read(PLAIN_READ_SIZE):
                yield chunk
            return
        dctx = zstandard.ZstdDecompressor()
        dobj = dctx.decompressobj()
        seen = False
        try:
            while raw := f.read(ZSTD_READ_SIZE):
                seen = True
                while raw:
                    out = dobj.decompress(raw)
                    if out:
                        yield out
                    raw = dobj.unused_data if dobj.eof else b""
                    if raw:  # a further frame (concatenated zstd streams are valid)
                        dobj = dctx.decompressobj()
        except zstandard.ZstdError as exc:
            raise CorruptShardError(url, f"zstd: {exc}") from None
        if seen and not dobj.eof:
            raise CorruptShardError(url, "truncated zstd stream (frame never ends)")


def _parse_slow(
    lines: list[bytes], first: int, url: str, on_error: str, bad: list[Quarantined]
) -> list[dict]:
    """Line-by-line parse that finds the offending line; used only when the fast path failed."""
    out: list[dict] = []
    for n, raw in enumerate(lines, first):
        if not raw.strip():
            continue
        try:
            rec = orjson.loads(raw)
            reason = None if type(rec) is dict else f"expected a JSON object, got {type(rec).__name__}"
        except orjson.JSONDecodeError as exc:
            rec, reason = None, str(exc)
            if "UTF-8" in reason:
                reason = f"invalid UTF-8 bytes ({reason})"
        if reason is None:
            out.append(rec)
        elif on_error == "quarantine":
            bad.append({"file": url, "line": n, "reason": reason, "raw": raw.decode("utf-8", "replace")})
        else:
            raise MalformedRecordError(url, n, reason)
    return out


def parse_lines(lines: list[bytes], first: int, url: str, on_error: str, bad: list[Quarantined]) -> list[dict]:
    """Parse a block of lines (first = 1-based number of lines[0]); fast path is one list comprehension."""
    loads = orjson.loads
    try:
        recs = [loads(x) for x in lines]
        for r in recs:
            if type(r) is not dict:
                break
        else:
            return recs
    except orjson.JSONDecodeError:
        pass
    return _parse_slow(lines, first, url, on_error, bad)


def iter_batches(
    fs: fsspec.AbstractFileSystem, path: str, url: str, compressed: bool, on_error: str
) -> Iterator[tuple[list[dict], list[Quarantined]]]:
    """Yield (records, quarantined) per chunk: the unit one thread hop carries."""
    if on_error not in ("raise", "quarantine"):
        raise ValueError(f"on_error must be 'raise' or 'quarantine', not {on_error!r}")
    tail = b""
    line_no = 1
    for chunk in iter_chunks(fs, path, url, compressed):
        lines = (tail + chunk if tail else chunk).split(b"\n")
        tail = lines.pop()
        if lines:
            bad: list[Quarantined] = []
            yield parse_lines(lines, line_no, url, on_error, bad), bad
            line_no += len(lines)
    if tail.strip():
        bad = []
        yield parse_lines([tail], line_no, url, on_error, bad), bad


# ---------------------------------------------------------------- writing


class AtomicFile:
    """A file that becomes visible under its final name only on ``commit()``.

    Local disk: a hidden temp file in the same directory, then ``os.replace`` (atomic).
    Object stores with multipart uploads (s3, gcs, ...): ``autocommit=False`` — the
    object appears only when the upload completes; ``discard`` aborts it.
    Anything else (memory://, ...): a hidden temp name, then ``fs.mv``.
    """

    _TRANSACTIONAL = ("s3", "s3a", "gs", "gcs", "abfs", "az")

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        self._f: Any = None
        self._tmp: str | None = None
        proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self._mode = "local" if urls.is_local(fs) else "txn" if proto in self._TRANSACTIONAL else "mv"

    def _open(self) -> None:
        parent, name = self.path.rsplit("/", 1) if "/" in self.path else ("", self.path)
        if self._mode == "txn":
            self._f = self.fs.open(self.path, "wb", autocommit=False)
            return
        self._tmp = f"{parent}/.{name}.tmp-{uuid.uuid4().hex[:12]}" if parent else f".{name}.tmp-{uuid.uuid4().hex[:12]}"
        if self._mode == "local":
            os.makedirs(parent or ".", exist_ok=True)
            self._f = open(self._tmp, "wb", buffering=0)  # noqa: SIM115 - closed in commit/discard
        else:
            self._f = self.fs.open(self._tmp, "wb")

    def write(self, data: bytes) -> None:
        if self._f is None:
            self._open()
        self._f.write(data)

    def commit(self) -> None:
        if self._f is None:
            self._open()
        if self._mode == "txn":
            self._f.close()
            self._f.commit()
        elif self._mode == "local":
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.path)
        else:
            self._f.close()
            self.fs.mv(self._tmp, self.path)
        self._f = None

    def discard(self) -> None:
        if self._f is None:
            return
        f, self._f = self._f, None
        if self._mode == "txn":
            f.discard()
            f.closed = True  # the buffer is gone: a later close() must not try to flush it
            return
        try:
            f.close()
        finally:
            if self._mode == "local":
                try:
                    os.unlink(self._tmp)
                except FileNotFoundError:
                    pass
            else:
                self.fs.rm(self._tmp)


class ShardStats(dict):
    """{name, records, bytes (uncompressed), stored_bytes} of one committed shard."""


class RotatingWriter:
    """Blocking core of every writer: takes encoded lines, rotates, compresses, commits.

    ``path_for(i)`` names shard i; ``on_commit(stats)`` is told about each committed
    shard. With no limits it writes exactly one file (JsonlFile.writer).
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path_for: Callable[[int], str],
        *,
        compressed: bool,
        max_records: int | None = None,
        max_bytes: int | None = None,
        zstd_level: int = DEFAULT_ZSTD_LEVEL,
        on_commit: Callable[[ShardStats], None] | None = None,
        always_create: bool = False,
    ) -> None:
        if max_records is not None and max_records < 1:
            raise ValueError("max_records_per_shard must be >= 1")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes_per_shard must be >= 1")
        self.fs, self.path_for, self.compressed = fs, path_for, compressed
        self.max_records = max_records or (1 << 62)
        self.max_bytes = max_bytes or (1 << 62)
        self.on_commit = on_commit
        self._cctx = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True) if compressed else None
        self.index = 0
        self._file: AtomicFile | None = None
        self._cobj: Any = None
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._shard_records = 0
        self._shard_bytes = 0
        self._stored = 0
        self._always_create = always_create
        self.records = 0
        self.bytes = 0
        self.committed: list[ShardStats] = []

    def write_lines(self, lines: list[bytes]) -> None:
        """Append encoded lines (each ending in a newline), rotating where a limit is reached."""
        max_records, max_bytes = self.max_records, self.max_bytes
        pending = self._pending
        for line in lines:
            n = len(line)
            if self._shard_records and (
                self._shard_records >= max_records or self._shard_bytes + n > max_bytes
            ):
                self._commit_shard()
                pending = self._pending
            pending.append(line)
            self._shard_records += 1
            self._shard_bytes += n
            self._pending_bytes += n
            if self._pending_bytes >= WRITE_BUFFER:
                self._flush()
                pending = self._pending
        self.records += len(lines)

    def _flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self.bytes += len(data)
        self._pending = []
        self._pending_bytes = 0
        if self._file is None:
            self._file = AtomicFile(self.fs, self.path_for(self.index))
            self._cobj = self._cctx.compressobj() if self._cctx else None
        if self._cobj is not None:
            data = self._cobj.compress(data)
        if data:
            self._stored += len(data)
            self._file.write(data)

    def _commit_shard(self) -> None:
        self._flush()
        if self._file is None:
            if not self._always_create:
                return
            self._file = AtomicFile(self.fs, self.path_for(self.index))
            self._cobj = self._cctx.compressobj() if self._cctx else None
        if self._cobj is not None:
            tail = self._cobj.flush()
            self._stored += len(tail)
            self._file.write(tail)
        path = self._file.path
        self._file.commit()
        stats = ShardStats(
            name=path.rsplit("/", 1)[-1], records=self._shard_records, bytes=self._shard_bytes, stored_bytes=self._stored
        )
        self.committed.append(stats)
        if self.on_commit is not None:
            self.on_commit(stats)
        self._file, self._cobj = None, None
        self._shard_records = self._shard_bytes = self._stored = 0
        self.index += 1

    def close(self) -> None:
        """Commit the last shard (an empty single-file writer still creates its file)."""
        self._commit_shard()

    def abort(self) -> None:
        """Drop the shard being written; committed shards are the caller's to clean up."""
        self._pending, self._pending_bytes = [], 0
        if self._file is not None:
            self._file.discard()
            self._file = None
