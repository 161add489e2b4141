"""Several batches on one model's pool: earliest deadline first, fair between projects.

Each batch is a pipeline run whose fan-out keeps up to ``runner.limit`` shard tasks in
flight. On one shared pool, a large batch alone would fill every slot and keep a small batch
behind all of its shards. ``FairShare`` sits between the runs and the pool: it holds the
pool's ``limit`` slots and, whenever one frees, gives it to a waiting task chosen by
``Admission`` (``api/admission.py``): the batches whose deadline (``expires_at``: its
``created_at`` + ``completion_window``) is within ``slack_s`` of the earliest waiting one
are of equal deadline; among them projects take turns, and a project's batches take turns.
A 1h batch so overtakes a 24h one from its next free slot, and a small batch of equal
deadline waits for at most one task of each other batch before its own start, whatever
their size; a batch alone gets every slot.

It also sees every task's result: the pool's measured rate (``Throughput``, which the
admission's finish estimates use) and a callback per result (usage: engine-seconds and
tokens per project).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from batch_inference.api.admission import Admission, Throughput
from batch_inference.pool.protocol import TaskResult, TaskRunner, TaskSpec

log = logging.getLogger(__name__)

OnResult = Callable[[str, TaskResult], Awaitable[None]]


class FairShare:
    """The slots of one pool, granted by deadline, then project, then batch (``for_batch``)."""

    def __init__(self, inner: TaskRunner, *, slack_s: float = 3600.0, on_result: OnResult | None = None, hold_s: float = 0.5) -> None:
        self.inner = inner
        self.free = max(1, inner.limit)
        self.hold_s = hold_s
        self._held: Counter[str] = Counter()  # slots kept for a batch that outranks every waiting one
        self.admission = Admission(slack_s)
        self.on_result = on_result
        self.granted: list[str] = []  # the batch of each task started, in order (tests, the bench)
        self.running: Counter[str] = Counter()  # tasks in flight per batch (metrics)
        self.throughput = Throughput()

    def for_batch(self, batch: str, *, deadline: float = math.inf, project: str = "") -> BatchRunner:
        """The ``TaskRunner`` batch ``batch``'s pipeline run dispatches through; ``deadline``
        (epoch seconds) orders it against the other batches, ``project`` shares ties."""
        return BatchRunner(self, batch, deadline, project)

    async def acquire(self, batch: str, deadline: float = math.inf, project: str = "") -> None:
        if self._take_held(batch):  # its own slot, kept since its last task returned
            self.granted.append(batch)
            return
        if self.free > 0 and not self.admission.waiting:
            self.free -= 1
            self.granted.append(batch)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.admission.wait(batch, deadline, project, fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted just as it was cancelled: hand the slot on
                self.release()
            else:
                self.admission.forget(batch, fut)
            raise

    def release(self, batch: str | None = None, deadline: float = math.inf) -> None:
        """A slot is free again. When ``batch``'s task returned it and ``batch`` outranks every
        waiting batch (an earlier deadline, beyond the slack), the slot stays ``batch``'s for
        ``hold_s``: its run dispatches its next task only after recording this one, and a
        later batch must not take the slot in that moment (else a 1h batch would share
        the pool with a 24h one, a slot at a time)."""
        if batch is not None and self.hold_s > 0 and self.admission.outranked_by(deadline):
            self._held[batch] += 1
            asyncio.get_running_loop().call_later(self.hold_s, self._unhold, batch)
            return
        self.free += 1
        while self.free > 0 and (picked := self.admission.next()) is not None:
            batch, fut = picked
            if fut.cancelled():
                continue
            self.free -= 1
            self.granted.append(batch)
            fut.set_result(None)

    def _unhold(self, batch: str) -> None:
        """The held slot's time is up: ``batch`` dispatched nothing more, the slot goes to the line."""
        if self._take_held(batch):
            self.release()

    def _take_held(self, batch: str) -> bool:
        if self._held[batch] <= 0:
            return False
        self._held[batch] -= 1
        if not self._held[batch]:
            del self._held[batch]
        return True

    async def finished(self, batch: str, result: TaskResult, started: float) -> None:
        """A task of ``batch`` returned: the pool's measured rate, then the result callback (never fatal to the task)."""
        self.throughput.add(result.records_in, started, time.monotonic())
        if self.on_result is not None:
            try:
                await self.on_result(batch, result)
            except Exception:  # usage bookkeeping must not fail a task whose records are committed
                log.exception("batch %s: recording a task's usage failed", batch)


class BatchRunner:
    """One batch's view of a ``FairShare`` pool: a ``TaskRunner`` for its ``PipelineRun``."""

    def __init__(self, share: FairShare, batch: str, deadline: float = math.inf, project: str = "") -> None:
        self.share, self.batch, self.deadline, self.project = share, batch, deadline, project

    @property
    def limit(self) -> int:
        return self.share.inner.limit

    @property
    def retried(self) -> int:
        return self.share.inner.retried

    async def stats(self) -> dict[str, Any]:
        return await self.share.inner.stats()

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        await self.share.acquire(self.batch, self.deadline, self.project)
        self.share.running[self.batch] += 1
        started = time.monotonic()
        try:
            result = await self.share.inner.run_task(spec)
        finally:
            self.share.running[self.batch] -= 1
            if self.share.running[self.batch] <= 0:
                del self.share.running[self.batch]
            self.share.release(self.batch, self.deadline)
        await self.share.finished(self.batch, result, started)
        return result
