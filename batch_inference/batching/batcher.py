"""DynamicBatcher (and ``batching.tokens.TokenBatcher``): an asyncio accumulator between many producer
coroutines and one batched model call.

Same API as the reference design's ``flyte.extras`` batchers (code ports with an import
change), rebuilt for throughput: no per-record Task, lock or ``asyncio.Queue`` hop. A
record is one tuple in a deque; ``submit`` awaits nothing while the queue has room; an
assembler task cuts the deque into budgeted batches ahead of the model call
(``prefetch_batches``) so the processor task calls the model back to back; futures are
resolved in bulk, one loop per batch.

Three tasks touch the state, all on one event loop, so no locks are needed:
producers (append to ``_pending``), the assembler (``_pending`` -> ``_ready``) and the
processor (``_ready`` -> ``process_fn`` -> futures). They wake each other through
one-shot futures, set only when someone is actually waiting.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from asyncio import InvalidStateError, get_running_loop
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic

from batch_inference.batching.costs import CostEstimatorFn, ProcessFn, R, T
from batch_inference.batching.stats import BatchStats, StatsRecorder

_MISSING: Any = object()


def _wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _short(record: object) -> str:
    text = repr(record)
    return text if len(text) <= 80 else text[:77] + "..."


class DynamicBatcher(Generic[T, R]):
    """Group records submitted by many coroutines into cost-budgeted batches for one
    ``process_fn(batch) -> results`` (same order, one result per record).

    A batch is dispatched when its cost reaches ``target_batch_cost`` (the crossing
    record is admitted in full; a record over the budget is a batch alone), when it
    holds ``max_batch_size`` records, or ``batch_timeout_s`` after its first record
    was dequeued. ``strict_budget=True`` makes the budget a ceiling instead: the
    crossing record opens the next batch, and a record that alone exceeds the budget
    fails with ``ValueError``. ``padded_cost=True`` prices a batch as
    ``n x max(record cost)``, for engines that pad every sequence to the longest.
    ``min_batch_size`` holds a timed-out batch open until it has that many records
    (never re-queues, so order is kept); ``stop()`` dispatches whatever is left.
    """

    _protocol_methods: tuple[str, ...] = ("estimate_cost",)
    _new_future: Callable[[], asyncio.Future[Any]]  # bound to the batcher's loop by start()

    def __init__(
        self,
        process_fn: ProcessFn[T, R],
        *,
        target_batch_cost: float = 32_000,
        max_batch_size: int = 256,
        min_batch_size: int = 1,
        batch_timeout_s: float = 0.05,
        prefetch_batches: int = 2,
        max_queue_size: int = 5_000,
        cost_estimator: CostEstimatorFn[T] | None = None,
        default_cost: float = 1,
        strict_budget: bool = False,
        padded_cost: bool = False,
        stats_window: int = 100,
    ) -> None:
        if not target_batch_cost > 0:
            raise ValueError(f"target_batch_cost must be > 0, got {target_batch_cost!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        if not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(f"min_batch_size must be in 1..max_batch_size ({max_batch_size}), got {min_batch_size!r}")
        if batch_timeout_s < 0:
            raise ValueError(f"batch_timeout_s must be >= 0, got {batch_timeout_s!r}")
        if prefetch_batches < 1:
            raise ValueError(f"prefetch_batches must be >= 1, got {prefetch_batches!r}")
        if max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0 (0 = unbounded), got {max_queue_size!r}")
        if not default_cost >= 0:
            raise ValueError(f"default_cost must be >= 0, got {default_cost!r}")
        self._process_fn = process_fn
        self._target = target_batch_cost
        self._max_batch_size = max_batch_size
        self._min_batch_size = min_batch_size
        self._timeout = batch_timeout_s
        self._prefetch = prefetch_batches
        self._max_queue = max_queue_size
        self._cost_estimator = cost_estimator
        self._default_cost = default_cost
        self._strict = strict_budget
        self._ceiling = target_batch_cost if strict_budget else math.inf  # a record's cost must not exceed it
        self._capacity = max_queue_size or math.inf  # submit() waits at this many queued records
        self._padded = padded_cost
        self._protocol_cache: dict[type, Callable[[Any], float] | None] = {}

        # (record, cost, future) in submission order; assembled batches of them, with their cost
        self._pending: deque[tuple[T, float, asyncio.Future[R]]] = deque()
        self._ready: deque[tuple[list[tuple[T, float, asyncio.Future[R]]], float]] = deque()
        self._space_waiters: deque[asyncio.Future[None]] = deque()
        self._data_waiter: asyncio.Future[None] | None = None
        self._slot_waiter: asyncio.Future[None] | None = None
        self._batch_waiter: asyncio.Future[None] | None = None

        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._closing = False
        self._accepting = False  # running and not closing: the one flag submit() reads
        self._assembly_done = False
        self._submitted = 0
        self._rejected = 0  # strict-budget records over the budget alone
        self._cancelled = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stats = StatsRecorder(target_batch_cost, max_batch_size, stats_window)

    # -- lifecycle ---------------------------------------------------------------

    @property
    def stats(self) -> BatchStats:
        """A fresh snapshot of the counters (see ``BatchStats``)."""
        depth = len(self._pending) + sum(len(b[0]) for b in self._ready)
        return self._stats.snapshot(depth, self._submitted, self._rejected, self._cancelled)

    @property
    def is_running(self) -> bool:
        return self._running

    async def start(self) -> None:
        """Start the assembler and processor tasks on the running loop; producers must
        share this loop."""
        if self._loop is not None:
            state = "running" if self._running else "stopped (a batcher is single-use)"
            raise RuntimeError(f"{type(self).__name__}.start() called twice: it is already {state}")
        self._loop = get_running_loop()
        self._new_future = functools.partial(asyncio.Future, loop=self._loop)
        self._running = self._accepting = True
        self._stats.started_at = time.perf_counter()
        self._tasks = [
            asyncio.create_task(self._assemble(), name="batcher-assembler"),
            asyncio.create_task(self._process(), name="batcher-processor"),
        ]

    async def stop(self) -> None:
        """Stop taking records, process everything already submitted, then end.

        If ``stop()`` itself is cancelled, the loops are cancelled and every future
        not yet resolved is cancelled too, so no caller waits forever."""
        if not self._running:
            return
        self._closing = True
        self._accepting = False
        _wake(self._data_waiter)
        while self._space_waiters:  # producers blocked on a full queue: they will raise
            _wake(self._space_waiters.popleft())
        try:
            results = await asyncio.gather(*self._tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for task in self._tasks:
                task.cancel()
            self._fail_unresolved(None)
            self._finish()
            raise
        self._finish()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:  # a bug in the loops themselves: never leave a future hanging
            self._fail_unresolved(errors[0])
            raise RuntimeError(f"{type(self).__name__} loop failed") from errors[0]

    def _finish(self) -> None:
        self._running = False
        self._stats.stopped_at = time.perf_counter()

    def _fail_unresolved(self, exc: BaseException | None) -> None:
        futures = [f for _, _, f in self._pending] + [item[2] for b in self._ready for item in b[0]]
        self._pending.clear()
        self._ready.clear()
        for fut in futures:
            if not fut.done():
                fut.cancel() if exc is None else fut.set_exception(exc)

    async def __aenter__(self) -> DynamicBatcher[T, R]:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- submission --------------------------------------------------------------

    async def submit(self, record: T, estimated_cost: float | None = None) -> asyncio.Future[R]:
        """Queue ``record``; return its future at once. Suspends only while the
        queue holds ``max_queue_size`` records (backpressure).

        Cost order: the explicit argument, the estimator function, the record's
        protocol method (looked up once per record type), the default. This is the
        hot path (one call per record): keep it flat."""
        if not self._accepting or get_running_loop() is not self._loop:
            self._refuse()
        if len(self._pending) >= self._capacity or self._space_waiters:
            await self._wait_for_space()
        if estimated_cost is None:
            if self._cost_estimator is not None:
                estimated_cost = self._cost_estimator(record)
            else:
                method = self._protocol_cache.get(type(record), _MISSING)
                if method is _MISSING:
                    method = self._protocol_method(type(record))
                estimated_cost = self._default_cost if method is None else method(record)
        fut: asyncio.Future[R] = self._new_future()
        try:
            admissible = 0 <= estimated_cost <= self._ceiling
        except TypeError:
            admissible = False
        if not admissible:
            self._inadmissible(record, estimated_cost, fut)
            return fut
        self._submitted += 1
        self._pending.append((record, estimated_cost, fut))
        if self._data_waiter is not None:
            _wake(self._data_waiter)
            self._data_waiter = None
        return fut

    async def submit_many(
        self, records: Iterable[T], estimated_costs: Sequence[float] | None = None
    ) -> list[asyncio.Future[R]]:
        """``submit`` for a chunk of records; one future per record, same order."""
        records = records if isinstance(records, Sequence) else list(records)
        if estimated_costs is not None and len(estimated_costs) != len(records):
            raise ValueError(f"submit_many got {len(records)} records but {len(estimated_costs)} estimated costs")
        if estimated_costs is None:
            return [await self.submit(r) for r in records]
        return [await self.submit(r, c) for r, c in zip(records, estimated_costs)]

    async def submit_batch(
        self, records: Sequence[T], *, estimated_cost: Sequence[float] | None = None
    ) -> list[asyncio.Future[R]]:
        """The reference design's name for ``submit_many``."""
        return await self.submit_many(records, estimated_cost)

    def _refuse(self) -> None:
        """Raise the reason this caller may not submit (cold path of ``submit``)."""
        name = type(self).__name__
        if self._loop is None:
            raise RuntimeError(f"{name} is not started: call `await start()` or use `async with` first")
        if not self._accepting:
            raise RuntimeError(f"{name} is stopped: submit() after stop() would never be processed")
        raise RuntimeError(
            f"{name}.submit() called from a different event loop than the one that started the "
            "batcher; its future would never resolve. Run producers on the batcher's loop."
        )

    def _inadmissible(self, record: T, cost: Any, fut: asyncio.Future[R]) -> None:
        """Cold path of ``submit``: a bad cost raises; a record over a strict budget
        alone fails its own future (blast radius: one record)."""
        try:
            valid = cost >= 0
        except TypeError:
            valid = False
        if not valid:
            raise ValueError(f"estimated cost of record {_short(record)} must be a number >= 0, got {cost!r}")
        self._submitted += 1
        self._rejected += 1
        fut.set_exception(
            ValueError(f"record {_short(record)} costs {cost} alone, over the strict budget of {self._target}")
        )

    def _protocol_method(self, cls: type) -> Callable[[Any], float] | None:
        method = next((m for name in self._protocol_methods if callable(m := getattr(cls, name, None))), None)
        self._protocol_cache[cls] = method
        return method

    async def _wait_for_space(self) -> None:
        """Wait in line for a queue slot; FIFO among blocked producers."""
        loop = self._loop
        assert loop is not None
        first = True
        while first or len(self._pending) >= self._capacity:
            first = False
            waiter: asyncio.Future[None] = loop.create_future()
            self._space_waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._release_space()  # we were handed a slot: pass it on
                else:
                    try:
                        self._space_waiters.remove(waiter)
                    except ValueError:
                        pass
                raise
            if self._closing:
                raise RuntimeError(f"{type(self).__name__} stopped before this record was queued")

    def _release_space(self) -> None:
        waiters = self._space_waiters
        free = (self._max_queue - len(self._pending)) if self._max_queue else len(waiters)
        while waiters and free > 0:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    # -- the two loops -----------------------------------------------------------

    async def _wait(self, attr: str, timeout: float | None = None) -> None:
        """Park until another task wakes ``self.<attr>`` (or ``timeout`` passes)."""
        loop = self._loop
        assert loop is not None
        fut: asyncio.Future[None] = loop.create_future()
        setattr(self, attr, fut)
        handle = loop.call_later(timeout, _wake, fut) if timeout is not None else None
        try:
            await fut
        finally:
            setattr(self, attr, None)
            if handle is not None:
                handle.cancel()

    async def _assemble(self) -> None:
        """Cut ``_pending`` into batches, up to ``prefetch_batches`` ahead of the model."""
        loop = self._loop
        assert loop is not None
        pending, ready = self._pending, self._ready
        popleft, pushback = pending.popleft, pending.appendleft
        target, max_n, strict, padded = self._target, self._max_batch_size, self._strict, self._padded
        try:
            while True:
                while len(ready) >= self._prefetch:
                    await self._wait("_slot_waiter")
                while not pending:
                    if self._closing:
                        return
                    await self._wait("_data_waiter")
                batch: list[tuple[T, float, asyncio.Future[R]]] = []
                add = batch.append
                n = 0
                cost = longest = 0.0
                deadline: float | None = None
                while True:
                    full = False
                    while pending:
                        item = popleft()
                        if item[2].done():  # cancelled by its producer: skip the model work
                            self._cancelled += 1
                            continue
                        c = item[1]
                        if padded:
                            widest = c if c > longest else longest
                            new_cost = (n + 1) * widest
                        else:
                            new_cost = cost + c
                        if strict and n and new_cost > target:
                            pushback(item)  # the crossing record opens the next batch
                            full = True
                            break
                        add(item)
                        n += 1
                        cost = new_cost
                        if padded:
                            longest = widest
                        if n >= max_n or new_cost >= target:
                            full = True
                            break
                    if self._space_waiters:
                        self._release_space()
                    if full:
                        break
                    if n and deadline is None:
                        deadline = loop.time() + self._timeout
                    if self._closing:
                        break
                    if deadline is None:  # every record seen so far was cancelled
                        await self._wait("_data_waiter")
                        continue
                    remaining = deadline - loop.time()
                    if remaining > 0:
                        await self._wait("_data_waiter", remaining)
                    elif n >= self._min_batch_size:
                        break
                    else:  # hold an undersized batch open: more records, or stop()
                        await self._wait("_data_waiter")
                if n:
                    ready.append((batch, cost))
                    _wake(self._batch_waiter)
        finally:
            self._assembly_done = True
            _wake(self._batch_waiter)

    async def _process(self) -> None:
        """Run ``process_fn`` on each assembled batch, back to back, and resolve its
        futures in one pass."""
        ready, stats, process_fn = self._ready, self._stats, self._process_fn
        clock = time.perf_counter
        while True:
            if not ready:
                if self._assembly_done:
                    return
                await self._wait("_batch_waiter")
                continue
            batch, cost = ready.popleft()
            _wake(self._slot_waiter)
            live = [item for item in batch if not item[2].done()]
            if len(live) < len(batch):  # cancelled by their producers while assembled: no model work for them
                self._cancelled += len(batch) - len(live)
                cost = len(live) * max(item[1] for item in live) if self._padded and live else sum(item[1] for item in live)
                batch = live
                if not batch:
                    continue
            n = len(batch)
            failed = 0
            start = clock()
            try:
                results = await process_fn([item[0] for item in batch])
                end = clock()
                if not isinstance(results, (list, tuple)):
                    results = list(results)
                if len(results) != n:
                    raise ValueError(
                        f"{type(self).__name__}: process_fn returned {len(results)} results "
                        f"for a batch of {n} records (it must return exactly one per record, in order)"
                    )
            except Exception as exc:
                end = clock()
                failed = n
                for item in batch:
                    if not item[2].done():
                        item[2].set_exception(exc)
            except BaseException as exc:
                end = clock()
                failed = n
                if self._fatal(exc, batch):
                    raise
            else:
                for item, result in zip(batch, results):
                    try:
                        if isinstance(result, Exception):
                            item[2].set_exception(result)
                            failed += 1
                        else:
                            item[2].set_result(result)
                    except InvalidStateError:  # its producer cancelled it meanwhile
                        pass
                    except TypeError:  # e.g. StopIteration cannot be raised into a future
                        item[2].set_exception(RuntimeError(f"process_fn returned unraisable {result!r}"))
                        failed += 1
            stats.record_batch(start, end, n, cost, failed)

    def _fatal(self, exc: BaseException, batch: list[Any]) -> bool:
        """Resolve a batch whose ``process_fn`` raised a ``BaseException``; True to stop the loop.

        The processor itself being cancelled (``stop()`` cancelled) cancels the batch.
        ``KeyboardInterrupt`` / ``SystemExit`` fail loudly: every unresolved future gets
        the error, submissions are refused, the loop ends (``stop()`` raises). Anything
        else (a Rust panic from a tokenizer is a ``BaseException``, so is a stray
        ``CancelledError`` from inside the model call) fails only this batch, as an
        ``Exception`` would, and the batcher keeps serving.
        """
        task = asyncio.current_task()
        if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
            for item in batch:
                item[2].cancel()
            return True
        error = RuntimeError(f"{type(self).__name__}: process_fn raised {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        for item in batch:
            if not item[2].done():
                item[2].set_exception(error)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            self._accepting = False
            self._fail_unresolved(error)
            return True
        return False
