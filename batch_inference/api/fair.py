"""Several batches on one model's pool, sharing it fairly.

Each batch is a pipeline run whose fan-out keeps up to ``runner.limit`` shard tasks in
flight. On one shared pool, a large batch alone would fill every slot and keep a small batch
behind all of its shards. ``FairShare`` sits between the runs and the pool: it holds the
pool's ``limit`` slots and, whenever one frees, gives it to the next batch in round-robin
order that has a task waiting. A small batch so waits for at most one task of each other
batch before its own start, whatever their size; a batch alone gets every slot.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from typing import Any

from batch_inference.pool.protocol import TaskResult, TaskRunner, TaskSpec


class FairShare:
    """The slots of one pool, granted round-robin across batches (``for_batch``)."""

    def __init__(self, inner: TaskRunner) -> None:
        self.inner = inner
        self.free = max(1, inner.limit)
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self.granted: list[str] = []  # the batch of each task started, in order (tests, the bench)

    def for_batch(self, batch: str) -> BatchRunner:
        """The ``TaskRunner`` batch ``batch``'s pipeline run dispatches through."""
        return BatchRunner(self, batch)

    async def acquire(self, batch: str) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            self.granted.append(batch)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(batch, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted just as it was cancelled: hand the slot on
                self.release()
            else:
                queue = self._waiting.get(batch)
                if queue is not None and fut in queue:
                    queue.remove(fut)
                    if not queue:
                        del self._waiting[batch]
            raise

    def release(self) -> None:
        self.free += 1
        while self.free > 0 and self._waiting:
            batch, queue = next(iter(self._waiting.items()))
            fut = queue.popleft()
            del self._waiting[batch]
            if queue:  # its next task goes to the back of the line
                self._waiting[batch] = queue
            if fut.cancelled():
                continue
            self.free -= 1
            self.granted.append(batch)
            fut.set_result(None)


class BatchRunner:
    """One batch's view of a ``FairShare`` pool: a ``TaskRunner`` for its ``PipelineRun``."""

    def __init__(self, share: FairShare, batch: str) -> None:
        self.share, self.batch = share, batch

    @property
    def limit(self) -> int:
        return self.share.inner.limit

    @property
    def retried(self) -> int:
        return self.share.inner.retried

    async def stats(self) -> dict[str, Any]:
        return await self.share.inner.stats()

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        await self.share.acquire(self.batch)
        try:
            return await self.share.inner.run_task(spec)
        finally:
            self.share.release()
