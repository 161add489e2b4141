"""JsonlFile and JsonlDir: streaming JSONL shards on any fsspec URL.

Reads stream in bounded chunks (zstd decompressed 256 KB of input at a time), one
thread hop per chunk, not per record. Writes encode with orjson on the caller's thread,
then compress and write 1 MiB blocks in a worker thread.
A file or shard becomes visible only when complete (see ``_io.AtomicFile``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from batch_inference.storage import _io, urls
from batch_inference.storage.errors import ConcurrentWriteError

QuarantineSink = Callable[[dict], Awaitable[None] | None]
OnError = Literal["raise", "quarantine"]
Compression = Literal["zstd"] | None

MANIFEST_NAME = "_manifest.json"
LOCK_NAME = "_writer.lock"
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
LOCK_TTL_S = 600.0  # a lock not refreshed for this long belongs to a dead writer
_SHARD_RE = re.compile(r"^[^._].*\.jsonl(\.zst)?$")
_DUMPS_OPT = orjson.OPT_APPEND_NEWLINE


def _natural_key(name: str) -> tuple:
    """Sort key that orders ``part-99999`` before ``part-100000`` (write order at any count)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _check_sink(on_error: str, quarantine: QuarantineSink | None) -> None:
    _io.check_on_error(on_error)
    if on_error == "quarantine" and quarantine is None:
        raise ValueError("on_error='quarantine' needs a quarantine sink")


# ---------------------------------------------------------------- JsonlFile


class JsonlFile:
    """One JSONL file (``.jsonl`` or zstd ``.jsonl.zst``) at any fsspec URL."""

    def __init__(self, url: str, *, storage_options: dict | None = None) -> None:
        self.url = urls.normalize(str(url))
        self.storage_options = storage_options
        self.fs, self.path = urls.fs_for(self.url, storage_options)

    @property
    def compressed(self) -> bool:
        return self.url.endswith(".zst")

    @property
    def name(self) -> str:
        return urls.basename(self.url)

    def __repr__(self) -> str:
        return f"JsonlFile({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JsonlFile) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    # reading -------------------------------------------------------------

    def _blocks(self) -> Iterator[tuple[str, int, list[bytes]]]:
        return _io.iter_blocks(self.fs, self.path, self.url, self.compressed)

    def iter_records_sync(
        self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None
    ) -> Iterator[dict]:
        """Stream records on this thread (CPU passes, scripts)."""
        return _sync_records(lambda: [self], on_error, quarantine)

    def iter_records(
        self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None
    ) -> AsyncIterator[dict]:
        """Stream records without blocking the loop (see ``_aiter_records``)."""
        _check_sink(on_error, quarantine)
        return _aiter_records(lambda: [self], on_error, quarantine)

    async def read_all(self) -> list[dict]:
        """Every record in a list: small files only (manifests, tests)."""
        return await asyncio.to_thread(lambda: list(self.iter_records_sync()))

    def exists_sync(self) -> bool:
        self.fs.invalidate_cache(self.path)  # another process may have written it since we listed
        return bool(self.fs.exists(self.path))

    async def exists(self) -> bool:
        return await asyncio.to_thread(self.exists_sync)

    # writing -------------------------------------------------------------

    def writer(self, *, zstd_level: int = _io.DEFAULT_ZSTD_LEVEL) -> JsonlWriter:
        """Async writer; the file appears (or is replaced whole) only on a clean exit."""
        core = _io.RotatingWriter(
            self.fs, lambda _i: self.path, compressed=self.compressed, zstd_level=zstd_level, always_create=True
        )
        return JsonlWriter(core, self.url)

    def writer_sync(self, *, zstd_level: int = _io.DEFAULT_ZSTD_LEVEL) -> SyncJsonlWriter:
        """Same as ``writer()`` for CPU passes that do not run an event loop."""
        core = _io.RotatingWriter(
            self.fs, lambda _i: self.path, compressed=self.compressed, zstd_level=zstd_level, always_create=True
        )
        return SyncJsonlWriter(core, self.url)


def _shard_blocks(list_shards: Callable[[], list[JsonlFile]]) -> Iterator[tuple[str, int, list[bytes]]]:
    """(url, first line number, lines) of every shard in order, as one stream: the async path
    makes one thread hop per chunk and none of its own per shard. Blocking (lists, reads,
    decompresses): runs in a thread for the async path."""
    for shard in list_shards():
        yield from shard._blocks()


def _sync_records(
    list_shards: Callable[[], list[JsonlFile]], on_error: str, quarantine: QuarantineSink | None
) -> Iterator[dict]:
    _check_sink(on_error, quarantine)

    def on_bad(entry: dict) -> None:
        if inspect.isawaitable(quarantine(entry)):  # type: ignore[misc]
            raise TypeError("iter_records_sync needs a synchronous quarantine sink")

    return _io.parse_blocks(_shard_blocks(list_shards), on_error, on_bad)  # one generator level per record


async def _aiter_records(
    list_shards: Callable[[], list[JsonlFile]], on_error: str, quarantine: QuarantineSink | None
) -> AsyncIterator[dict]:
    """The async hot path, shared by JsonlFile and JsonlDir (one generator level per record).

    Listing, read + decompress + line split run in a thread, one ~1 MiB chunk per hop;
    each line is then parsed as it is yielded (about a microsecond on the loop), lazily for
    the reason given in ``_io.parse_blocks``. (Reading the next chunk ahead in the thread
    was measured: no faster, the thread waits for the GIL while the loop parses.)
    """
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    blocks = _shard_blocks(list_shards)
    # A reader cancelled while its thread is inside next() must not close the generator
    # under it ("generator already executing"): both take this lock, so close waits.
    lock = threading.Lock()

    def step() -> tuple[str, int, list[bytes]] | None:
        with lock:
            return next(blocks, None)

    def close() -> None:
        with lock:
            blocks.close()

    try:
        while (item := await asyncio.to_thread(step)) is not None:
            url, first, lines = item
            it = iter(lines)
            for raw in it:
                try:
                    rec = loads(raw)
                except decode_error as exc:
                    entry = _io._bad_line(raw, first + len(lines) - it.__length_hint__() - 1, url, exc, on_error)
                    if entry is not None:
                        await _deliver(entry, quarantine)
                    continue
                if type(rec) is dict:
                    yield rec
                else:
                    n = first + len(lines) - it.__length_hint__() - 1
                    await _deliver(_io._bad_line(raw, n, url, None, on_error), quarantine)
    finally:
        await asyncio.to_thread(close)


async def _deliver(entry: dict | None, quarantine: QuarantineSink | None) -> None:
    """Hand a quarantined line to the sink on the loop (the sink may be async)."""
    res = quarantine(entry)  # type: ignore[misc,arg-type]
    if inspect.isawaitable(res):
        await res


class _WriterBase:
    def __init__(self, core: _io.RotatingWriter, url: str) -> None:
        self._core = core
        self.url = url
        self._buf: list[bytes] = []
        self._buf_bytes = 0
        self._sent_records = 0  # handed to the core (a block may still be in flight)
        self._sent_bytes = 0
        self._closed = False

    @property
    def records(self) -> int:
        return self._sent_records + len(self._buf)

    @property
    def bytes(self) -> int:
        """Uncompressed bytes written so far."""
        return self._sent_bytes + self._buf_bytes

    @property
    def shards_written(self) -> int:
        """Shards committed so far (the last one commits on exit)."""
        return len(self._core.committed)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"writer for {self.url} is closed")


class SyncJsonlWriter(_WriterBase):
    """Blocking writer: ``with f.writer_sync() as w: w.write(rec)``."""

    def write(self, rec: dict) -> None:
        line = orjson.dumps(rec, option=_DUMPS_OPT)
        self._buf.append(line)
        self._buf_bytes += len(line)
        if self._buf_bytes >= _io.WRITE_BUFFER:
            self._drain()

    def write_many(self, recs: Iterable[dict]) -> None:
        dumps, opt, limit = orjson.dumps, _DUMPS_OPT, _io.WRITE_BUFFER
        buf, size = self._buf, self._buf_bytes
        for rec in recs:
            line = dumps(rec, option=opt)
            buf.append(line)
            size += len(line)
            if size >= limit:
                self._buf_bytes = size
                self._drain()
                buf, size = self._buf, 0
        self._buf_bytes = size

    def _drain(self) -> None:
        self._check_open()
        buf, nbytes, self._buf, self._buf_bytes = self._buf, self._buf_bytes, [], 0
        self._sent_records += len(buf)
        self._sent_bytes += nbytes
        self._core.write_lines(buf, nbytes)

    def commit(self) -> None:
        self._drain()
        self._core.close()
        self._closed = True

    def abort(self) -> None:
        self._closed = True
        self._buf = []
        self._core.abort()

    def __enter__(self) -> SyncJsonlWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _write_block(core: _io.RotatingWriter, box: list[list[bytes]], nbytes: int, wake: Callable[[], None]) -> None:
    """Thread side of a block hand-over. The lines come in a box emptied here, so that the
    executor's work item does not keep them alive past the loop's own reference."""
    core.write_lines(box.pop(), nbytes, wake)


def _set_once(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class JsonlWriter(_WriterBase):
    """Async writer: ``async with f.writer() as w: await w.write(rec)``.

    Records are encoded on the loop (a microsecond each); every ~1 MiB the block goes to
    this writer's own thread, which compresses and writes it while the loop encodes the
    next one. The loop waits until the thread has *started* the block (taken the GIL for
    its Python part and entered compress/write, which release it): handing it over and
    encoding on at once was measured slower, the thread then waits up to the 5 ms GIL
    switch interval just to start. One block in flight at most (bounded memory, blocks
    land in order); its error is raised by the next block hand-over or the commit. All
    core work runs on that one thread, so an abort always comes after the block in flight.
    """

    def __init__(self, core: _io.RotatingWriter, url: str) -> None:
        super().__init__(core, url)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: concurrent.futures.Future | None = None
        self._inflight_lines: list[bytes] | None = None  # freed here, on the loop's thread

    async def write(self, rec: dict) -> None:
        line = orjson.dumps(rec, option=_DUMPS_OPT)
        self._buf.append(line)
        self._buf_bytes += len(line)
        if self._buf_bytes >= _io.WRITE_BUFFER:
            await self._drain()

    async def write_many(self, recs: Iterable[dict]) -> None:
        dumps, opt, limit = orjson.dumps, _DUMPS_OPT, _io.WRITE_BUFFER
        buf, size = self._buf, self._buf_bytes
        for rec in recs:
            line = dumps(rec, option=opt)
            buf.append(line)
            size += len(line)
            if size >= limit:
                self._buf_bytes = size
                await self._drain()
                buf, size = self._buf, 0
        self._buf_bytes = size

    def _submit(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jsonl-writer")
        return self._pool.submit(fn, *args)

    async def _settle(self) -> None:
        """Wait for the block in flight; raise its error."""
        fut, self._inflight = self._inflight, None
        if fut is not None:
            if not fut.done():
                await asyncio.wrap_future(fut)
            # The block's lines die here, not in the thread: orjson allocated them on this
            # thread, and freed from another one glibc hands their pages back to the OS, so
            # the next block faults them in again (measured: 3x the page faults, -30%).
            self._inflight_lines = None
            fut.result()

    async def _drain(self) -> None:
        """Hand the buffered block to the thread; return once it is compressing/writing."""
        self._check_open()
        buf, nbytes, self._buf, self._buf_bytes = self._buf, self._buf_bytes, [], 0
        await self._settle()
        if not buf:
            return
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def wake() -> None:  # in the thread: at the start of compress/write, or on an early error
            try:
                loop.call_soon_threadsafe(_set_once, started)
            except RuntimeError:  # the loop is gone (writer abandoned): nobody is waiting
                pass

        self._sent_records += len(buf)
        self._sent_bytes += nbytes
        self._inflight_lines = buf
        self._inflight = self._submit(_write_block, self._core, [buf], nbytes, wake)
        self._inflight.add_done_callback(lambda _f: wake())
        await started

    async def _run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writer's thread once the block in flight has landed."""
        await self._settle()
        await asyncio.wrap_future(self._submit(fn))

    def _release(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # work already queued (an abort) still runs
            self._pool = None

    async def commit(self) -> None:
        await self._drain()
        await self._run(self._core.close)
        self._release()

    async def abort(self) -> None:
        self._closed = True
        self._buf = []
        self._inflight_lines = None
        try:
            try:
                await self._settle()
            except Exception:  # noqa: BLE001 - aborting anyway; the first error is the one raised
                pass
            await asyncio.wrap_future(self._submit(self._core.abort))
        finally:
            self._release()

    async def __aenter__(self) -> JsonlWriter:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                await self.commit()
            except BaseException:
                await self.abort()
                raise
        else:
            await self.abort()


# ---------------------------------------------------------------- JsonlDir


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
        names = [n for n in self._listed_names() if _SHARD_RE.match(n)]
        return [self._file(n) for n in sorted(names, key=_natural_key)]

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
        return _sync_records(self.shards, on_error, quarantine)

    def iter_records(
        self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None
    ) -> AsyncIterator[dict]:
        _check_sink(on_error, quarantine)
        return _aiter_records(self.shards, on_error, quarantine)

    # writing -------------------------------------------------------------

    def _core(
        self, max_records_per_shard: int | None, max_bytes_per_shard: int, compression: Compression,
        prefix: str, zstd_level: int,
    ) -> _DirSession:
        if compression not in ("zstd", None):
            raise ValueError(f"compression must be 'zstd' or None, not {compression!r}")
        return _DirSession(self, max_records_per_shard, max_bytes_per_shard, compression, prefix, zstd_level)

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
    ) -> SyncJsonlDirWriter:
        return SyncJsonlDirWriter(self._core(max_records_per_shard, max_bytes_per_shard, compression, prefix, zstd_level))


class _DirSession:
    """Blocking lifecycle of one directory write: lock, clear, rotate, manifest, unlock."""

    def __init__(
        self, d: JsonlDir, max_records: int | None, max_bytes: int, compression: Compression, prefix: str, level: int
    ) -> None:
        self.dir = d
        self.compression = compression
        self.token = uuid.uuid4().hex
        self.lock_path = f"{d.path}/{LOCK_NAME}"
        self._last_beat = 0.0
        self.core = _io.RotatingWriter(
            d.fs,
            lambda i: f"{d.path}/{urls.basename(d.shard_url(i, compression, prefix))}",
            compressed=compression == "zstd",
            max_records=max_records,
            max_bytes=max_bytes,
            zstd_level=level,
            on_block=self._heartbeat,
        )

    # lock ------------------------------------------------------------------

    def _lock_body(self) -> bytes:
        return orjson.dumps({"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()})

    def _read_lock(self) -> dict | None:
        try:
            with self.dir.fs.open(self.lock_path, "rb") as f:
                return orjson.loads(f.read())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None

    @staticmethod
    def _stale(holder: dict) -> bool:
        if time.time() - holder.get("heartbeat", 0) > LOCK_TTL_S:
            return True
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder["pid"]), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, KeyError, ValueError):
                return False
        return False

    def _acquire(self) -> None:
        fs = self.dir.fs
        fs.makedirs(self.dir.path, exist_ok=True)
        for _ in range(2):
            try:
                with fs.open(self.lock_path, "xb") as f:  # O_EXCL / If-None-Match: one winner
                    f.write(self._lock_body())
                self._last_beat = time.monotonic()
                return
            except OSError as exc:
                if not _io.create_refused(exc):
                    raise
            holder = self._read_lock()
            if holder is not None and not self._stale(holder):
                raise ConcurrentWriteError(self.dir.url, holder, "directory is being written by another writer") from None
            fs.rm(self.lock_path)  # a dead writer's lock
        raise ConcurrentWriteError(self.dir.url, self._read_lock(), "could not take the directory lock")

    def _heartbeat(self) -> None:
        if time.monotonic() - self._last_beat < LOCK_TTL_S / 10:
            return
        self._verify_lock()
        beat = _io.AtomicFile(self.dir.fs, self.lock_path)  # never seen truncated: a reader must not
        beat.write(self._lock_body())  # take an empty lock file for a dead writer's
        beat.commit()
        self._last_beat = time.monotonic()

    def _verify_lock(self) -> None:
        holder = self._read_lock()
        if holder is None or holder.get("token") != self.token:
            raise ConcurrentWriteError(self.dir.url, holder, "lost the directory lock to another writer")

    def _release(self) -> None:
        holder = self._read_lock()
        if holder is not None and holder.get("token") == self.token:
            self.dir.fs.rm(self.lock_path)

    # lifecycle -------------------------------------------------------------

    def open(self) -> None:
        self._acquire()
        try:
            fs, path = self.dir.fs, self.dir.path
            fs.invalidate_cache(path)
            stale = [e for e in fs.ls(path, detail=False) if _SHARD_RE.match(urls.basename(e)) or urls.basename(e) == MANIFEST_NAME]
            if stale:
                fs.rm(sorted(stale, key=lambda e: urls.basename(e) != MANIFEST_NAME))  # manifest first
        except BaseException:
            self._release()
            raise

    def commit(self) -> None:
        try:
            self.core.close()
            self._verify_lock()
            c = self.core
            man = DirManifest(shards=list(c.committed), records=c.records, bytes=c.bytes, compression=self.compression)
            _io_file = _io.AtomicFile(self.dir.fs, f"{self.dir.path}/{MANIFEST_NAME}")
            _io_file.write(man.to_json())
            _io_file.commit()
        finally:
            self._release()

    def abort(self) -> None:
        self.core.abort()
        holder = self._read_lock()
        if holder is not None and holder.get("token") != self.token:
            return  # another writer took the directory over: its shards carry our names, leave them
        try:
            paths = [self.core.path_for(i) for i in range(self.core.index)]
            if paths:
                self.dir.fs.rm(paths)
        finally:
            self._release()


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
        return self

    def write(self, rec: dict) -> None:
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
