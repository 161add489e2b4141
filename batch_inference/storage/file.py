"""JsonlFile and its writers: one JSONL file (plain or zstd) on any fsspec URL.

Reads stream in bounded chunks (zstd decompressed 256 KB of input at a time), one
thread hop per chunk, not per record. Writes encode with orjson on the caller's thread,
then compress and write 1 MiB blocks in a worker thread.
A file becomes visible only when complete (see ``_io.AtomicFile``). The read path
(``sync_records``, ``aiter_records``) and the writers are shared with ``JsonlDir``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Literal

import orjson

from batch_inference.storage import _io, urls
from batch_inference.storage.errors import MalformedRecordError

QuarantineSink = Callable[[dict], Awaitable[None] | None]
OnError = Literal["raise", "quarantine"]

_DUMPS_OPT = orjson.OPT_APPEND_NEWLINE


def check_sink(on_error: str, quarantine: QuarantineSink | None) -> None:
    _io.check_on_error(on_error)
    if on_error == "quarantine" and quarantine is None:
        raise ValueError("on_error='quarantine' needs a quarantine sink")


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
        return sync_records(lambda: [self], on_error, quarantine)

    def iter_numbered_sync(
        self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None
    ) -> Iterator[tuple[int, dict]]:
        """``(0-based line number, record)`` on this thread: blank and malformed lines count."""
        return numbered_records(lambda: [self], on_error, quarantine)

    def iter_parsed_lines_sync(self) -> Iterator[tuple[dict, bytes]]:
        """``(record, its line)`` on this thread (see ``parsed_lines``)."""
        return parsed_lines(lambda: [self])

    def iter_records(
        self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None
    ) -> AsyncIterator[dict]:
        """Stream records without blocking the loop (see ``aiter_records``)."""
        check_sink(on_error, quarantine)
        return aiter_records(lambda: [self], on_error, quarantine)

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


def sync_sink(on_error: str, quarantine: QuarantineSink | None) -> Callable[[dict], None]:
    check_sink(on_error, quarantine)

    def on_bad(entry: dict) -> None:
        if inspect.isawaitable(quarantine(entry)):  # type: ignore[misc]
            raise TypeError("iter_records_sync needs a synchronous quarantine sink")

    return on_bad


def sync_records(
    list_shards: Callable[[], list[JsonlFile]], on_error: str, quarantine: QuarantineSink | None
) -> Iterator[dict]:
    return _io.parse_blocks(_shard_blocks(list_shards), on_error, sync_sink(on_error, quarantine))  # one generator level per record


def parsed_lines(list_shards: Callable[[], list[JsonlFile]]) -> Iterator[tuple[dict, bytes]]:
    """Every record with the line it was read from (newline kept, exactly its size): passes
    that move records keep the line and need not encode them again. Blank lines are skipped;
    a malformed line raises ``MalformedRecordError`` (directories the pipeline wrote have none)."""
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    for url, first, lines in _shard_blocks(list_shards):
        for k, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                rec = loads(raw)
            except decode_error as exc:
                raise MalformedRecordError(url, first + k, str(exc)) from None
            if type(rec) is not dict:
                raise MalformedRecordError(url, first + k, "expected a JSON object")
            yield rec, raw if raw.endswith(b"\n") else raw + b"\n"


def numbered_records(
    list_shards: Callable[[], list[JsonlFile]], on_error: str, quarantine: QuarantineSink | None
) -> Iterator[tuple[int, dict]]:
    """``(0-based line number across the shards, record)``: blank and malformed lines count."""
    return _io.parse_numbered_blocks(_shard_blocks(list_shards), on_error, sync_sink(on_error, quarantine))


async def aiter_records(
    list_shards: Callable[[], list[JsonlFile]], on_error: str, quarantine: QuarantineSink | None
) -> AsyncIterator[dict]:
    """The async hot path, shared by JsonlFile and JsonlDir (one generator level per record).

    Listing, read + decompress + line split run in a thread, one ~1 MiB chunk per hop;
    each line is then parsed as it is yielded (about a microsecond on the loop), lazily for
    the reason given in ``_io.parse_blocks``. (No read-ahead in the thread: it would wait
    for the GIL while the loop parses; docs/storage.md.)
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

    def write_lines(self, lines: Iterable[bytes]) -> None:
        """Already-encoded records, each one JSON object ending in a newline (passes that
        move records without parsing them: no decode, no re-encode)."""
        buf, size, limit = self._buf, self._buf_bytes, _io.WRITE_BUFFER
        for line in lines:
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

    def cut(self) -> None:
        """A directory writer's current shard ends here (where a pass chooses its boundaries)."""
        self._drain()
        self._core.cut()

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
    encoding on at once is slower: the thread then waits up to the 5 ms GIL
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
            # the next block faults them in again (docs/storage.md).
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
