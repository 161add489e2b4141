"""Blocking byte-level I/O under JsonlFile/JsonlDir: chunked reads, line parsing, atomic writes.

Everything here is synchronous on purpose: the async API runs these functions in a
thread, one *block* (thousands of records) per hop, never one record per hop.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import fsspec
import orjson
import zstandard

from batch_inference.storage import urls
from batch_inference.storage.errors import CorruptShardError, MalformedRecordError

PLAIN_READ_SIZE = 1 << 20  # raw bytes per read of a plain shard
ZSTD_READ_SIZE = 1 << 18  # compressed bytes per step: ~1 MiB decompressed at 3-4x, one thread hop
WRITE_BUFFER = 1 << 20  # uncompressed bytes gathered before one compress + write
DEFAULT_ZSTD_LEVEL = 3

Quarantined = dict[str, Any]  # {file, line, reason, raw}


# ---------------------------------------------------------------- reading


def _open(fs: fsspec.AbstractFileSystem, path: str, url: str) -> Any:
    fs.invalidate_cache(path)  # a cached listing may hold the size of a since-rewritten shard
    try:
        if urls.is_local(fs):  # the OS file itself: fsspec's wrapper costs a Python call per line
            return open(path, "rb", buffering=0)  # noqa: SIM115 - the caller closes it
        return fs.open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"No such file: {url}") from None


def zstd_chunks(fs: fsspec.AbstractFileSystem, path: str, url: str, read_size: int = ZSTD_READ_SIZE) -> Iterator[bytes]:
    """Yield the decompressed bytes of a zstd file, what ``read_size`` of input makes at a time."""
    with _open(fs, path, url) as f:
        dctx = zstandard.ZstdDecompressor()
        dobj = dctx.decompressobj()
        seen = False
        try:
            while raw := f.read(read_size):
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


def _bad_line(raw: bytes, n: int, url: str, exc: Exception | None, on_error: str) -> Quarantined | None:
    """Classify a line the fast path refused: blank (skip), or malformed (raise or quarantine)."""
    if exc is None:
        reason = "expected a JSON object"
    elif not raw.strip():
        return None
    else:
        reason = str(exc)
        if "UTF-8" in reason:
            reason = f"invalid UTF-8 bytes ({reason})"
    if on_error != "quarantine":
        raise MalformedRecordError(url, n, reason)
    raw = raw[:-1] if raw.endswith(b"\n") else raw
    return {"file": url, "line": n, "reason": reason, "raw": raw.decode("utf-8", "replace")}


def parse_blocks(
    blocks: Iterable[tuple[str, int, list[bytes]]], on_error: str, on_bad: Callable[[Quarantined], None]
) -> Iterator[dict]:
    """Parse (url, number of the first line, lines) blocks lazily, one generator level per record.

    Lazily, not a block at a time: a consumer that drops each record before the next keeps
    the allocator and the cyclic GC as idle as a bare ``for line in f: loads(line)`` loop
    (a list of a block's dicts triggers GC passes over the whole heap; docs/storage.md).
    Line numbers are worked out only for a bad line (from the list iterator's position).
    """
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    for url, first, lines in blocks:
        it = iter(lines)
        for raw in it:
            try:
                rec = loads(raw)
            except decode_error as exc:
                bad = _bad_line(raw, first + len(lines) - it.__length_hint__() - 1, url, exc, on_error)
                if bad is not None:
                    on_bad(bad)
                continue
            if type(rec) is dict:
                yield rec
            else:
                on_bad(_bad_line(raw, first + len(lines) - it.__length_hint__() - 1, url, None, on_error))  # type: ignore[arg-type]


def parse_numbered_blocks(
    blocks: Iterable[tuple[str, int, list[bytes]]], on_error: str, on_bad: Callable[[Quarantined], None]
) -> Iterator[tuple[int, dict]]:
    """``(index, record)`` from the same blocks as ``parse_blocks``: ``index`` is the 0-based
    number of the record's line across the whole stream, blank and malformed lines counted,
    so ids made from it name the line a quarantine entry would (its ``line`` is 1-based, per file)."""
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    index = 0
    for url, first, lines in blocks:
        for k, raw in enumerate(lines):
            try:
                rec = loads(raw)
            except decode_error as exc:
                if (bad := _bad_line(raw, first + k, url, exc, on_error)) is not None:
                    on_bad(bad)
                continue
            if type(rec) is dict:
                yield index + k, rec
            else:
                on_bad(_bad_line(raw, first + k, url, None, on_error))  # type: ignore[arg-type]
        index += len(lines)


class _ChunkStream(io.RawIOBase):
    """Decompressed chunks as a raw stream, so a BufferedReader can cut them into lines."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._view = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._view:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._view = memoryview(chunk)
        n = min(len(b), len(self._view))
        b[:n] = self._view[:n]
        self._view = self._view[n:]
        return n

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]  # closes the file under it
        super().close()


def iter_blocks(
    fs: fsspec.AbstractFileSystem, path: str, url: str, compressed: bool, block_bytes: int = PLAIN_READ_SIZE,
) -> Iterator[tuple[str, int, list[bytes]]]:
    """Yield (url, number of the first line, ~1 MiB of lines) at a time: the unit one thread hop carries.

    ``readlines(1 MiB)`` on a 1 MiB BufferedReader: C cuts the lines and carries a line
    cut at a chunk's end over to the next read (faster than bytes.split plus joining the
    cut line). Lines keep their newline; orjson takes it as whitespace.
    ``block_bytes`` is smaller where many files are read at once (a merge of sorted runs).
    """
    zstd_read = max(1 << 12, block_bytes * ZSTD_READ_SIZE // PLAIN_READ_SIZE)
    raw = _ChunkStream(zstd_chunks(fs, path, url, zstd_read)) if compressed else _open(fs, path, url)
    with io.BufferedReader(raw, block_bytes) as reader:
        line_no = 1
        while lines := reader.readlines(block_bytes):
            yield url, line_no, lines
            line_no += len(lines)


def create_refused(exc: BaseException) -> bool:
    """Whether an exclusive create (``fs.open(path, "xb")``) failed because the object exists.

    Locally that is ``FileExistsError``. On S3 it is HTTP 412 to ``If-None-Match: *``;
    s3fs turns that into ``FileExistsError`` only when the error body names the condition
    (AWS, moto), otherwise into ``OSError(EINVAL)`` (SeaweedFS answers a plain 412).
    """
    if isinstance(exc, FileExistsError):
        return True
    response = getattr(exc.__cause__, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code == "PreconditionFailed" or status == 412


def check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "quarantine"):
        raise ValueError(f"on_error must be 'raise' or 'quarantine', not {on_error!r}")


# ---------------------------------------------------------------- writing


class AtomicFile:
    """A file that becomes visible under its final name only on ``commit()``.

    Local disk: a hidden temp file in the same directory, then ``os.replace`` (atomic).
    Object stores with multipart uploads (s3, gcs, ...): ``autocommit=False`` — the
    object appears only when the upload completes; ``discard`` aborts it.
    Anything else (memory://, ...): a hidden temp name, then ``fs.mv``.
    """

    _TRANSACTIONAL = ("s3", "s3a", "gs", "gcs", "abfs", "az")
    # Atomic rename is enough for readers and for a killed process; set True (or
    # BATCH_INFERENCE_FSYNC=1) to also survive a power loss of the node.
    fsync = os.environ.get("BATCH_INFERENCE_FSYNC", "") == "1"

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
        if self._mode != "local":
            self._f.write(data)
            return
        # An unbuffered local write may be short (disk nearly full) without raising:
        # write the rest until it all lands or the OS raises (ENOSPC), never commit a cut file.
        view = memoryview(data)
        try:
            while view:
                view = view[self._f.write(view) :]
        except OSError as exc:  # name the file: "[Errno 28] No space left on device: '<path>'"
            if exc.filename is None:
                raise OSError(exc.errno, exc.strerror, self.path) from exc
            raise

    def commit(self) -> None:
        if self._f is None:
            self._open()
        if self._mode == "txn":
            self._f.close()
            self._f.commit()
        elif self._mode == "local":
            if self.fsync:
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
    shard and ``on_block()`` about each block written (the directory lock's heartbeat).
    With no limits it writes exactly one file (JsonlFile.writer).
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
        on_block: Callable[[], None] | None = None,
        always_create: bool = False,
    ) -> None:
        if max_records is not None and max_records < 1:
            raise ValueError("max_records_per_shard must be >= 1")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes_per_shard must be >= 1")
        self.fs, self.path_for, self.compressed = fs, path_for, compressed
        self.max_records = max_records or (1 << 62)
        self.max_bytes = max_bytes or (1 << 62)
        self.on_commit, self.on_block = on_commit, on_block
        self._on_busy: Callable[[], None] | None = None
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

    def write_lines(
        self, lines: list[bytes], nbytes: int | None = None, on_busy: Callable[[], None] | None = None
    ) -> None:
        """Append encoded lines (each ending in a newline), rotating where a limit is reached.

        Takes ownership of ``lines`` (it may be kept as the pending block, not copied).
        ``on_busy`` is called once, just before the first compress/write, the part that
        runs without the GIL: the async writer resumes encoding then, not when it ends.

        ``nbytes`` (their total length, when the caller knows it) enables the bulk path:
        whole slices go in without a per-line loop unless the byte limit may bind.
        """
        self._on_busy = on_busy
        try:
            while lines:
                if self._shard_records >= self.max_records:
                    self._commit_shard()
                room = self.max_records - self._shard_records
                part = lines if room >= len(lines) else lines[:room]
                size = nbytes if part is lines and nbytes is not None else sum(map(len, part))
                if self._shard_bytes + size <= self.max_bytes:
                    self._take(part, size)
                else:  # the byte limit falls inside this slice: go line by line
                    part = self._take_until_full(part)
                lines = lines[len(part) :]
                nbytes = None
        finally:
            self._on_busy = None

    def _take(self, part: list[bytes], size: int) -> None:
        if self._pending:
            self._pending.extend(part)
        else:  # the common case, a whole block: keep the caller's list (no copy; it hands it over)
            self._pending = part
        self._pending_bytes += size
        self._shard_records += len(part)
        self._shard_bytes += size
        self.records += len(part)
        if self._pending_bytes >= WRITE_BUFFER:
            self._flush()

    def _take_until_full(self, part: list[bytes]) -> list[bytes]:
        """Take lines while they fit (at least one per shard: a huge record gets a shard alone)."""
        taken = 0
        for line in part:
            n = len(line)
            if self._shard_records and self._shard_bytes + n > self.max_bytes:
                self._commit_shard()
                break
            self._take([line], n)
            taken += 1
        return part[:taken]

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
        if self._on_busy is not None:
            self._on_busy()
            self._on_busy = None
        if self._cobj is not None:
            data = self._cobj.compress(data)
        if data:
            self._stored += len(data)
            self._file.write(data)
        if self.on_block is not None:
            self.on_block()

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

    def cut(self) -> None:
        """End the current shard here (when it holds any record): the next line starts a new one."""
        if self._shard_records:
            self._commit_shard()

    def close(self) -> None:
        """Commit the last shard (an empty single-file writer still creates its file)."""
        self._commit_shard()

    def abort(self) -> None:
        """Drop the shard being written; committed shards are the caller's to clean up."""
        self._pending, self._pending_bytes = [], 0
        if self._file is not None:
            self._file.discard()
            self._file = None
