"""Helpers for the pipeline tests: a small JSONL input, a spec on the simulated engine, and
runner wrappers that count or fail tasks around a real pool."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.pool.protocol import TaskFailed, TaskResult, TaskSpec
from batch_inference.storage import JsonlDir


def write_input(path: Path, n: int, *, with_ids: bool = False) -> Path:
    with open(path, "wb") as f:
        for i in range(n):
            rec: dict[str, Any] = {"prompt": f"question number {i}"}
            if with_ids:
                rec["id"] = f"q{i}"
            f.write(orjson.dumps(rec) + b"\n")
    return path


def spec_dict(tmp_path: Path, *, records: int = 600, approval: float = 0.5, **overrides: Any) -> dict[str, Any]:
    """A fast spec: simulated engine (0.2 ms per call), 100-record shards, 4 task slots."""
    src = tmp_path / "input.jsonl"
    if not src.exists():
        write_input(src, records)
    data: dict[str, Any] = {
        "run": "test-run",
        "input": str(src),
        "output": str(tmp_path / "out"),
        "engine": {"kind": "simulated", "simulated": {"approval_rate": approval, "latency_a_s": 0.0002, "latency_b_s": 0.0}},
        "infer": {"template": "Answer: {prompt}", "sampling": {"max_tokens": 8, "seed": 7}},
        "judge": {"kind": "llm", "template": "Judge this answer: {result}"},
        "strategy": "rounds",
        "max_rounds": 3,
        "max_attempts": 5,
        "shard_records": 100,
        "chunk_size": 50,
        "pool": {"concurrency": 4, "retries": 1, "batcher": {"batch_timeout_s": 0.002}},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


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


async def run_infer_on_adapter_judge_on_base(spec: PipelineSpec, *, records: int, adapter: str) -> dict[str, dict[str, Any]]:
    """Run ``spec`` (one round, infer on ``adapter``, an LLM judge on the base model) and
    check what any engine must give: every record inferred without error, the ledger naming
    the adapter for infer and none for the judge, which judged them all. Round 0's inferred
    rows, by id."""
    summary = await run_pipeline(spec)
    assert summary.conservation["ok"] and summary.failed == 0
    root = Path(spec.output) / spec.run
    rows = {r["id"]: r for r in JsonlDir(str(root / "round-00" / "inferred")).iter_records_sync()}
    assert len(rows) == records and all(r["error"] is None for r in rows.values())
    ledger = root / "ledger"
    assert orjson.loads((ledger / "round-00-infer.json").read_bytes())["ran_on"]["adapter"] == adapter
    judge = orjson.loads((ledger / "round-00-judge.json").read_bytes())
    assert judge["ran_on"]["adapter"] is None and judge["records_in"] == records and judge["tokens_out"] > 0
    return rows
