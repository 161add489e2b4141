"""The engine and its one shared way in, as a worker holds them.

A worker process builds its engine exactly once (``loads`` counts it). Every concurrent
shard task submits to the host, which feeds the engine one of two ways:

- a blocking ``Engine`` (transformers, the linear simulated model) gets one
  ``TokenBatcher``: records of different tasks merge into full batches, one
  ``generate`` call each, on the engine's own thread;
- a ``StreamingEngine`` (vLLM) gets a ``StreamGate``: requests flow straight in, each
  resolves on its own, at most ``capacity()`` in flight (admission control instead of
  a batch barrier).

Either way ``submit`` returns one future per request and suspends only while the way
in is full (the backpressure). Per-item engine errors come back as
``Completion(error=...)``; ``EngineDeadError`` means the engine itself is gone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from batch_inference.batching import TokenBatcher
from batch_inference.engines import (
    Completion,
    Engine,
    EngineConfig,
    EngineOccupancy,
    Prompt,
    StreamingEngine,
    Tokens,
    build_engine,
    is_streaming,
)
from batch_inference.pool.dedup import DEFAULT_MEMO_BYTES, RequestMemo
from batch_inference.pool.heap import freeze_static_heap
from batch_inference.pool.request import GenRequest
from batch_inference.pool.streaming import StreamGate

log = logging.getLogger(__name__)


class BatcherOptions(BaseModel):
    """The worker's TokenBatcher settings (the reference's defaults)."""

    model_config = ConfigDict(extra="forbid")

    target_batch_tokens: int = Field(12_800, ge=1)
    max_batch_size: int = Field(256, ge=1)
    batch_timeout_s: float = Field(0.05, gt=0)
    prefetch_batches: int = Field(2, ge=1)
    max_queue_size: int = Field(5_000, ge=1)


class EngineHost:
    """Owns the engine and its batcher or gate for one worker; ``async with`` starts and stops them."""

    def __init__(self, engine_config: EngineConfig | dict[str, Any], batcher: BatcherOptions | None = None,
                 *, memo_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self.engine_config = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig.model_validate(engine_config)
        self.batcher_options = batcher or BatcherOptions()
        # identical deterministic requests of one phase, across this worker's tasks (pool.dedup)
        self.memo = RequestMemo(memo_bytes)
        self.engine: Engine | StreamingEngine | None = None
        self.batcher: TokenBatcher | None = None  # blocking engines
        self.gate: StreamGate | None = None  # streaming engines
        self.loads = 0  # engine builds in this process: 1 for a healthy worker, however many tasks
        self.load_time_s = 0.0
        self.engine_busy_s = 0.0
        # The engine gets its own thread: on the default executor a batch would queue
        # behind the storage layer's read/write hops and the GPU would sit idle.
        self._engine_thread: ThreadPoolExecutor | None = None
        self._together = asyncio.Lock()  # one run of ``together`` requests admitted at a time (FIFO)
        self._identity: str | None = None
        self._identity_known = False
        self._identity_lock = asyncio.Lock()  # concurrent first tasks hash the model's files once
        # why this engine's answers are not cached (its model has no content identity), or None
        self.uncacheable: str | None = None
        self.uncacheable_reported = False  # said once, on the first task that looked

    async def identity(self) -> str | None:
        """The model's identity for the result cache (``pool.result_cache.engine_identity``):
        its files fingerprinted once per worker, off the event loop; None (and ``uncacheable``
        says why) when nothing identifies them, so nothing of this engine is cached."""
        async with self._identity_lock:
            if not self._identity_known:
                from batch_inference.pool.result_cache import NotCacheable, engine_identity

                device = getattr(self.engine, "device", None)  # as the engine resolved "auto"
                try:
                    self._identity = await asyncio.to_thread(engine_identity, self.engine_config,
                                                             device=device if isinstance(device, str) else None)
                except NotCacheable as exc:
                    self.uncacheable = str(exc)
                    log.warning("result cache off for this engine: %s", exc)
                self._identity_known = True
        return self._identity

    async def start(self) -> None:
        """Build the engine and its way in; on any failure release what was made (the engine
        thread, a streaming engine's core process) before the error goes on."""
        if self.engine is not None:
            return
        try:
            await self._start()
        except BaseException:
            try:
                await self.close()
            except Exception:  # the start's own error is the one to report
                log.exception("releasing the engine after a failed start failed")
            raise

    async def _start(self) -> None:
        t0 = time.perf_counter()
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine = await self._build()
        self.loads += 1
        freeze_static_heap()  # the engine's modules and weights' Python side: never walked by a full GC again
        if is_streaming(self.engine):
            await self.engine.start()
            self.gate = StreamGate(self.engine, self.engine.capacity())
            self.load_time_s = time.perf_counter() - t0
            return
        self.load_time_s = time.perf_counter() - t0
        o = self.batcher_options
        self.batcher = TokenBatcher(
            self._infer_batch,
            target_batch_tokens=o.target_batch_tokens,
            max_batch_size=o.max_batch_size,
            batch_timeout_s=o.batch_timeout_s,
            prefetch_batches=o.prefetch_batches,
            max_queue_size=o.max_queue_size,
        )
        await self.batcher.start()

    async def _build(self) -> Engine | StreamingEngine:
        """The engine, built on its thread. A build cannot be interrupted (its thread runs it to
        the end, and the process waits for that thread at exit), so a start cancelled meanwhile
        waits for it and keeps what it made in ``engine``, for ``start`` to close, before the
        cancellation goes on: vLLM's engine core process is up once the build returns."""
        build = asyncio.ensure_future(self._on_engine_thread(build_engine, self.engine_config))
        cancelled: asyncio.CancelledError | None = None
        while True:
            try:
                await asyncio.shield(build)
            except asyncio.CancelledError as exc:
                if build.cancelled():  # the build itself (its loop is closing), not the caller
                    raise
                cancelled = exc
                if not build.done():
                    continue
            except Exception:
                if cancelled is None:
                    raise
            break
        if cancelled is None:
            return build.result()
        if build.exception() is None:
            self.engine = build.result()
        raise cancelled

    @property
    def streaming(self) -> bool:
        return self.gate is not None

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
            self.batcher = None
        if self.gate is not None:
            await self.gate.stop()
            self.gate = None
        if self.engine is not None:
            if is_streaming(self.engine):
                await self.engine.aclose()
            else:
                await self._on_engine_thread(self.engine.close)
            self.engine = None
        if self._engine_thread is not None:
            self._engine_thread.shutdown(wait=False)
            self._engine_thread = None

    async def __aenter__(self) -> EngineHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def encode(self, prompts: list[Prompt]) -> list[Tokens | Completion]:
        """Each prompt's ``Tokens`` (or its failed Completion): one tokenizer pass per chunk, off
        the event loop. The engine runs these ids as they are, so a prompt is tokenised once."""
        if not prompts:
            return []
        return await asyncio.to_thread(self._engine().encode, prompts)

    async def submit(self, requests: list[GenRequest], *, together: bool = False) -> list[asyncio.Future[Completion]]:
        """One future per request; suspends only while the batcher's queue (or the gate) is full.

        ``together``: the requests go in as one run, in their order, with no other caller's
        ``together`` requests between them (callers take turns, first come first served),
        so requests sorted by prefix reach the engine's cache side by side even while
        other tasks submit.
        """
        if not together:
            return await self._submit(requests)
        async with self._together:
            return await self._submit(requests)

    async def _submit(self, requests: list[GenRequest]) -> list[asyncio.Future[Completion]]:
        if self.gate is not None:
            return await self.gate.submit_many(requests)
        if self.batcher is None:
            raise RuntimeError("EngineHost is not started")
        return await self.batcher.submit_many(requests, [r.cost for r in requests])

    @property
    def engine_busy(self) -> float:
        """Seconds the engine had work: inside ``generate`` calls, or with a request in flight."""
        return self.gate.busy_s if self.gate is not None else self.engine_busy_s

    def occupancy(self) -> EngineOccupancy | None:
        """The engine's own view of how full it is (streaming engines report it)."""
        return self.engine.occupancy() if self.gate is not None and self.engine is not None else None

    async def _infer_batch(self, batch: list[GenRequest]) -> list[Completion]:
        engine = self._engine()
        t0 = time.perf_counter()
        completions = await self._on_engine_thread(engine.generate, [r.prompt for r in batch], [r.params for r in batch])
        busy = time.perf_counter() - t0
        self.engine_busy_s += busy
        total = sum(r.cost for r in batch) or 1
        fill = total / self.batcher_options.target_batch_tokens
        for r in batch:
            r.engine_s = busy * r.cost / total
            r.fill = fill
        return completions

    async def _on_engine_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, functools.partial(fn, *args))

    def _engine(self) -> Engine | StreamingEngine:
        if self.engine is None:
            raise RuntimeError("EngineHost is not started")
        return self.engine
