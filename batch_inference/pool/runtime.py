"""What a worker does with tasks, independent of HTTP: slots, idempotency, draining, stats.

``WorkerRuntime`` runs up to ``concurrency`` shard tasks at once on one event loop over
one ``EngineHost``. It is idempotent by ``task_id`` (a finished task answers from its
cached result while its output shards still exist, else it runs again; a running one is
joined, never started twice) and refuses work beyond its slots with ``Busy`` (retryable). The HTTP worker and ``InProcessPool`` both use it,
so the pipeline's fast tests run exactly the code a real worker runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from batch_inference.engines import EngineDeadError, prefix_block_size, prefix_cache_stats
from batch_inference.pool.engine_host import EngineHost
from batch_inference.pool.protocol import TaskResult, TaskRunner, TaskSpec
from batch_inference.pool.context import TaskContext
from batch_inference.pool.tasks import run_task
from batch_inference.storage import JsonlFile

log = logging.getLogger(__name__)

class Refused(Exception):
    """The worker will not run this task now; ``retryable`` says whether elsewhere/later may work."""

    status = 503
    retryable = True


class Busy(Refused):
    """Every slot is taken (the dispatcher's limit normally prevents this)."""

    status = 429


class Draining(Refused):
    """The worker is shutting down and takes no new tasks."""


class EngineDead(Refused):
    """The worker's engine died: this worker can run nothing; another can (retryable)."""


class Abandoned(Refused):
    """The task was cancelled by a shutdown before it finished; its output was discarded."""


class Cancelled(Refused):
    """The task was cancelled by its client (``WorkerRuntime.cancel``) before it finished:
    its output shards were discarded, what it committed (checkpoints, progress) kept."""


class SpecConflict(Refused):
    """The same task_id was sent with a different spec."""

    status = 409
    retryable = False


class UnknownStorageProfile(Refused):
    status = 400
    retryable = False


class WorkerRuntime:
    """Slots, idempotency and counters for one worker process."""

    def __init__(
        self,
        host: EngineHost,
        *,
        concurrency: int = 10,
        name: str | None = None,
        storage_profiles: dict[str, dict[str, Any]] | None = None,
        checkpoint_interval_s: float = 5.0,
        result_cache: int = 10_000,
        judge_runner: TaskRunner | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.host = host
        self.concurrency = concurrency
        self.name = name or f"pid{os.getpid()}"
        self.storage_profiles = storage_profiles or {}
        self.checkpoint_interval_s = checkpoint_interval_s
        self.result_cache = result_cache
        self.judge_runner = judge_runner  # the judge's own pool, for retry tasks that judge there
        self.running: dict[str, tuple[TaskSpec, asyncio.Task[TaskResult]]] = {}
        # callers waiting on each running task: the last one to leave cancels it (nobody
        # wants its result any more, so its engine work stops; docs/pool.md "Cancel")
        self._callers: dict[str, int] = {}
        self._cancelled: weakref.WeakSet[asyncio.Task[TaskResult]] = weakref.WeakSet()  # by a client, not a shutdown
        self._slot_freed = asyncio.Event()  # set as each task ends: callers that wait for a slot look again
        self.finished: OrderedDict[str, tuple[TaskSpec, TaskResult]] = OrderedDict()
        self.draining = False
        # Set once the engine died: the worker is unhealthy, refuses new tasks and exits
        # (its tasks are retried elsewhere); ``on_engine_dead`` lets the server stop.
        self.engine_dead: str | None = None
        self.on_engine_dead: Callable[[str], None] | None = None
        self.started_at = time.monotonic()
        self.last_activity = time.monotonic()
        self.counters = {"completed": 0, "failed": 0, "cached": 0, "refused": 0, "abandoned": 0, "cancelled": 0,
                         "records": 0, "tokens_in": 0, "tokens_out": 0, "duplicates": 0, "result_cache_lookups": 0, "result_cache_hits": 0,
                         "prefix_queried": 0, "prefix_hits": 0}

    # -- tasks --------------------------------------------------------------

    def storage_options(self, spec: TaskSpec) -> dict[str, Any] | None:
        """The worker-side storage profile a task names (credentials never travel in a task)."""
        ref = spec.storage_options_ref
        if ref is None:
            return self.storage_profiles.get("default")
        if ref not in self.storage_profiles:
            raise UnknownStorageProfile(f"task {spec.task_id}: unknown storage profile {ref!r} (configured: {sorted(self.storage_profiles)})")
        return self.storage_profiles[ref]

    async def run(self, spec: TaskSpec, *, wait: bool = False) -> TaskResult:
        """Run ``spec`` (or join/replay it); raises ``Refused`` subclasses or the task's error.

        ``wait``: with every slot taken, wait for one instead of refusing with ``Busy`` (a
        caller with no other worker to go to: ``InProcessPool``)."""
        while True:
            try:
                claimed = await self._claim(spec)
                break
            except Busy:
                if not wait:
                    self.counters["refused"] += 1
                    raise
            self._slot_freed.clear()  # no await since the slots were counted: a slot freed later sets it
            await self._slot_freed.wait()
        return claimed if isinstance(claimed, TaskResult) else await self._join(spec.task_id, claimed)

    async def _claim(self, spec: TaskSpec) -> TaskResult | asyncio.Task[TaskResult]:
        """A finished task's cached result, or the running task to join (started here, in a free slot)."""
        if spec.task_id in self.finished:
            done_spec, result = self.finished[spec.task_id]
            if done_spec != spec:
                raise SpecConflict(f"task {spec.task_id} already finished with a different spec")
            if await self._outputs_exist(spec):
                self.finished.move_to_end(spec.task_id)
                self.counters["cached"] += 1
                return result.model_copy(update={"cached": True})
            # The answer would stand for files that are gone (deleted, a wiped bucket): run it again.
            log.info("task %s finished here before, but its outputs are gone: running it again", spec.task_id)
            self.finished.pop(spec.task_id, None)
        if spec.task_id in self.running:
            run_spec, task = self.running[spec.task_id]
            if run_spec != spec:
                raise SpecConflict(f"task {spec.task_id} is running with a different spec")
            return task
        if self.engine_dead is not None:
            self.counters["refused"] += 1
            raise EngineDead(f"worker {self.name}: engine dead ({self.engine_dead})")
        if self.draining:
            self.counters["refused"] += 1
            raise Draining(f"worker {self.name} is shutting down")
        if len(self.running) >= self.concurrency:
            raise Busy(f"worker {self.name}: all {self.concurrency} slots busy")
        options = self.storage_options(spec)
        task = asyncio.create_task(self._execute(spec, options), name=f"task-{spec.task_id}")
        # A caller that went away (run stopped) leaves the shielded task to finish alone:
        # its error is already logged by _execute, so mark it retrieved (no asyncio noise).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        task.add_done_callback(lambda t: self._ended(spec.task_id, t))
        self.running[spec.task_id] = (spec, task)
        self.last_activity = time.monotonic()
        return task

    def _ended(self, task_id: str, task: asyncio.Task[TaskResult]) -> None:
        """Frees the slot of a task however it ended (one cancelled before its first step never
        reaches ``_execute``'s own cleanup)."""
        if (entry := self.running.get(task_id)) is not None and entry[1] is task:
            self.running.pop(task_id, None)
            self._slot_freed.set()

    async def _outputs_exist(self, spec: TaskSpec) -> bool:
        options = self.storage_options(spec)
        files = [JsonlFile(url, storage_options=options) for url in spec.output_files()]
        return all(await asyncio.gather(*(f.exists() for f in files)))

    async def _join(self, task_id: str, task: asyncio.Task[TaskResult]) -> TaskResult:
        """The task's result. Shielded: one caller that goes away leaves it to the others; the
        last one gone cancels it (its queued requests leave the batcher, a streaming engine
        aborts its own) and waits for it to end, so what it committed is on storage when
        the caller's cancellation goes on."""
        self._callers[task_id] = self._callers.get(task_id, 0) + 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                if task in self._cancelled:
                    raise Cancelled(f"task {task_id} cancelled by its client") from None
                raise Abandoned(f"task {task.get_name()} abandoned by shutdown") from None
            if self._callers.get(task_id, 0) <= 1 and not task.done():
                self._cancel(task_id, task, "its caller went away")
                await asyncio.wait([task])
            raise
        finally:
            left = self._callers.get(task_id, 1) - 1
            if left > 0:
                self._callers[task_id] = left
            else:
                self._callers.pop(task_id, None)

    def _cancel(self, task_id: str, task: asyncio.Task[TaskResult], why: str) -> None:
        if task not in self._cancelled:
            log.info("task %s cancelled: %s", task_id, why)
        self._cancelled.add(task)
        task.cancel()

    async def cancel(self, task_id: str) -> bool:
        """Cancel a running task and wait for it to end (its output discarded, its checkpoints
        and progress flushed). False: no task of that id runs here (finished, or never came)."""
        entry = self.running.get(task_id)
        if entry is None or entry[1].done():
            return False
        task = entry[1]
        self._cancel(task_id, task, "on its client's request")
        await asyncio.wait([task])
        return True

    async def _execute(self, spec: TaskSpec, storage_options: dict[str, Any] | None) -> TaskResult:
        t0 = time.perf_counter()
        ctx = TaskContext(spec, self.host, storage_options, checkpoint_interval_s=self.checkpoint_interval_s,
                          judge_runner=self.judge_runner)
        try:
            counts = await run_task(ctx)
            await ctx.settle_cache_writes()
        except EngineDeadError as exc:
            self.counters["failed"] += 1
            self.mark_engine_dead(exc)
            raise
        except asyncio.CancelledError:
            if asyncio.current_task() in self._cancelled:
                self.counters["cancelled"] += 1
                log.info("task %s cancelled after %d record(s) read; its output shards were not committed",
                         spec.task_id, ctx.meter.records_in)
            else:
                self.counters["abandoned"] += 1
                log.warning("task %s abandoned (shutdown); no output was committed", spec.task_id)
            raise
        except Exception:
            self.counters["failed"] += 1
            log.exception("task %s (%s %s) failed", spec.task_id, spec.kind, spec.input_url)
            raise
        finally:
            ctx.drop_cache_writes()
            self.running.pop(spec.task_id, None)
            self.last_activity = time.monotonic()
            self._slot_freed.set()
        m = ctx.meter
        result = TaskResult(
            task_id=spec.task_id, kind=spec.kind, worker=self.name, counts=counts,
            records_in=m.records_in, tokens_in=m.tokens_in, tokens_out=m.tokens_out,
            wall_s=time.perf_counter() - t0, engine_busy_s=m.engine_s, avg_fill=m.avg_fill,
            duplicates=m.duplicates, duplicate_tokens_in=m.duplicate_tokens_in, duplicate_tokens_out=m.duplicate_tokens_out,
            prefix_queried=m.prefix_queried, prefix_hits=m.prefix_hits,
            prefix_blocks=m.prefix_blocks.to_text() if m.prefix_blocks is not None else None,
            prefix_block_size=prefix_block_size(self.host.engine) if m.prefix_blocks is not None else None,
            prefix_tail_tokens=m.prefix_tail_tokens,
            result_cache_lookups=m.cache_lookups, result_cache_hits=m.cache_hits, engine_requests=m.requests,
            warnings=ctx.warnings,
        )
        for warning in ctx.warnings:
            log.warning("task %s: %s", spec.task_id, warning)
        self.counters["completed"] += 1
        self.counters["records"] += m.records_in
        self.counters["tokens_in"] += m.tokens_in
        self.counters["tokens_out"] += m.tokens_out
        self.counters["duplicates"] += m.duplicates
        self.counters["result_cache_lookups"] += m.cache_lookups
        self.counters["result_cache_hits"] += m.cache_hits
        self.counters["prefix_queried"] += m.prefix_queried
        self.counters["prefix_hits"] += m.prefix_hits
        self.finished[spec.task_id] = (spec, result)
        while len(self.finished) > self.result_cache:
            self.finished.popitem(last=False)
        return result

    def mark_engine_dead(self, exc: BaseException) -> None:
        """Record that the engine is gone (first cause wins) and tell the server, once."""
        if self.engine_dead is not None:
            return
        self.engine_dead = f"{type(exc).__name__}: {exc}"
        log.error("worker %s: engine dead (%s); unhealthy, its tasks go to other workers", self.name, self.engine_dead)
        if self.on_engine_dead is not None:
            self.on_engine_dead(self.engine_dead)

    async def drain(self, grace_s: float) -> list[str]:
        """Stop taking tasks; let running ones finish within ``grace_s``, then abandon the rest.

        Abandoned tasks are cancelled inside their writers, so no partial output is
        committed; their callers get ``Abandoned`` (retryable elsewhere). Returns their ids.
        """
        self.draining = True
        tasks = [t for _, t in self.running.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        late = [tid for tid, (_, t) in self.running.items() if not t.done()]
        for tid in late:
            self.running[tid][1].cancel()
        await asyncio.gather(*(t for _, t in list(self.running.values())), return_exceptions=True)
        return late

    # -- observability --------------------------------------------------------

    @property
    def idle_s(self) -> float:
        """Seconds since the last task ended (0 while any runs)."""
        return 0.0 if self.running else time.monotonic() - self.last_activity

    def stats(self) -> dict[str, Any]:
        """Everything ``/stats`` shows: batcher or stream figures, tasks, engine occupancy.

        "Is the engine full?" is answered by ``output_tokens_per_s`` (against the engine's
        own ceiling, bench/engine_ceiling.py) and ``occupancy`` (the engine's running and
        waiting requests, KV-cache use); ``utilization`` and ``avg_fill`` only say whether
        the engine was being fed (docs/pool.md "Is the GPU full?").
        """
        host = self.host
        batcher = host.batcher.stats.as_dict() if host.batcher is not None else None
        stream = host.gate.stats.as_dict() if host.gate is not None else None
        feed = batcher or stream
        occupancy = host.occupancy()
        uptime = time.monotonic() - self.started_at
        tokens = self.counters["tokens_in"] + self.counters["tokens_out"]
        wall = feed["wall_time_s"] if feed else 0.0
        tokens_out = stream["output_tokens"] if stream else self.counters["tokens_out"]
        return {
            "worker": self.name,
            "pid": os.getpid(),
            "engine": getattr(host.engine, "name", None),
            "mode": "stream" if stream else "batch",
            "engine_loads": host.loads,
            "engine_dead": self.engine_dead,
            "model_load_time_s": host.load_time_s,
            # wall time the engine had work (inside generate calls / a request in flight), measured here
            "engine_busy_s": host.engine_busy,
            # the engine's own account of its model time, when it keeps one (the simulated engine's cost model)
            "engine_model_busy_s": getattr(host.engine, "busy_s", None),
            "uptime_s": uptime,
            "idle_s": self.idle_s,
            "draining": self.draining,
            "concurrency": self.concurrency,
            "tasks_running": len(self.running),
            "tasks_completed": self.counters["completed"],
            "tasks_failed": self.counters["failed"],
            "tasks_cached": self.counters["cached"],
            "tasks_refused": self.counters["refused"],
            "tasks_abandoned": self.counters["abandoned"],
            "tasks_cancelled": self.counters["cancelled"],
            "records_done": self.counters["records"],
            "tokens_in": self.counters["tokens_in"],
            "tokens_out": self.counters["tokens_out"],
            "output_tokens_per_s": tokens_out / wall if wall > 0 else 0.0,
            "utilization": feed["utilization"] if feed else 0.0,
            "avg_fill": feed["avg_fill"] if feed else 0.0,
            "records_per_s": feed["records_per_s"] if feed else 0.0,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "in_flight": stream["in_flight"] if stream else None,
            "capacity": stream["capacity"] if stream else None,
            "engine_running": occupancy.running if occupancy else None,
            "engine_waiting": occupancy.waiting if occupancy else None,
            "kv_cache_usage": occupancy.kv_cache_usage if occupancy else None,
            "batcher": batcher,
            "stream": stream,
            # identical requests computed once (pool.dedup): led, joined, replayed, orphaned
            "dedup": host.memo.stats(),
            "prefix_cache": self._prefix_cache(),
        }

    def _prefix_cache(self) -> dict[str, Any] | None:
        """The engine's prefix cache: its own counters (vLLM's scheduler figures, preemptions
        included) where it keeps them, else the finished tasks' per-request figures."""
        own = prefix_cache_stats(self.host.engine) if self.host.engine is not None else None
        if own is not None:
            return {**own.as_dict(), "source": "engine"}
        queried, hits = self.counters["prefix_queried"], self.counters["prefix_hits"]
        if not queried:
            return None
        return {"queries": queried, "hits": hits, "hit_rate": round(hits / queried, 4), "computed": queried - hits,
                "source": "requests"}
