"""Runner wrappers for the pipeline tests: they count or fail tasks around a real pool."""

from __future__ import annotations

from collections import Counter

from typing import Any

from batch_inference.pool.protocol import TaskFailed, TaskResult, TaskSpec


class CountingRunner:
    """Counts the tasks the pipeline dispatches, by kind; everything else is the real pool's."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.task_ids: list[str] = []

    @property
    def limit(self) -> int:
        return self.inner.limit

    @property
    def retried(self) -> int:
        return self.inner.retried

    async def stats(self) -> dict:
        return await self.inner.stats()

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        self.calls[spec.kind] += 1
        self.task_ids.append(spec.task_id)
        return await self.inner.run_task(spec)


class FailingShardRunner(CountingRunner):
    """Acts as a pool whose every retry of one shard's ``phase`` task failed."""

    def __init__(self, inner, *, shard_name: str, kind: str) -> None:
        super().__init__(inner)
        self.shard_name, self.kind = shard_name, kind

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        if spec.kind == self.kind and spec.input_url.endswith(self.shard_name):
            self.calls["failed"] += 1
            raise TaskFailed(spec, ["OSError: device lost", "OSError: device lost", "OSError: device lost"])
        return await super().run_task(spec)


class InstantRunner:
    """A pool whose one-record tasks take no time and touch no storage: a phase run on it
    costs only the driver's own work (its ledger reads and writes)."""

    def __init__(self, limit: int = 8) -> None:
        self.limit, self.retried = limit, 0

    async def stats(self) -> dict[str, Any]:
        return {}

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        counts = {"ok": 1, "error": 0} if spec.kind == "infer" else {"approved": 1, "rejected": 0}
        return TaskResult(task_id=spec.task_id, kind=spec.kind, worker="instant", counts=counts, records_in=1)
