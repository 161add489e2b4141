"""A step's shard task, built in one place: every ``TaskSpec`` of a run carries the same
request, chunking, cache, dedup, affinity and progress settings, and differs only in kind,
round, input and outputs (and, for a judge or the tail, the judge and attempts left)."""

from __future__ import annotations

from typing import Any

from batch_inference.pipeline.steps.context import RunContext
from batch_inference.pool.protocol import TaskKind, TaskSpec


def task_spec(ctx: RunContext, r: int, kind: TaskKind, index: int, input_url: str, outputs: dict[str, str], *,
              step: str, instance: str, families: dict[int, str], **extra: Any) -> TaskSpec:
    """Shard ``index``'s task of step ``step`` (round ``r``); ``extra``: ``judge``, ``max_attempts``."""
    spec, layout = ctx.spec, ctx.layout
    return TaskSpec(
        task_id=layout.task_id(r, kind, index, instance=instance), kind=kind, input_url=input_url,
        affinity=families.get(index), outputs=outputs, infer=spec.request_infer, chunk_size=spec.chunk_size, round=r,
        storage_options_ref=spec.pool.storage_options_ref, order=ctx.order, result_cache=spec.result_cache_url,
        dedup_scope=layout.phase_key(r, kind, instance=instance) if spec.dedup else None,
        progress_url=layout.live_progress_file(step, index), **extra,
    )
