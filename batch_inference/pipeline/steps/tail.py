"""The in-place tail (Strategy 2, and the hybrid's end): each record of pending(r) retried in
its own task to approval or ``max_attempts``, its rows split into results and tail/unfinished."""

from __future__ import annotations

import asyncio
from typing import Any

from batch_inference.pipeline import passes
from batch_inference.pipeline.fanout import Phase
from batch_inference.pipeline.layout import RunLayout, part
from batch_inference.pipeline.steps.context import RunContext, StepOrderError
from batch_inference.pipeline.steps.tasks import task_spec
from batch_inference.pipeline.summaries import PhaseSummary
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT, TaskResult, TaskRunner, TaskSpec
from batch_inference.storage import JsonlFile
from batch_inference.storage.urls import join


async def tail(ctx: RunContext, from_round: int, runner: TaskRunner | None) -> PhaseSummary:
    """Strategy 2 over pending(from_round). Records in pending(r) have had ``r`` attempts, so
    each task gets the attempts left (``max_attempts - r``)."""
    spec, layout = ctx.spec, ctx.layout
    if (done := await asyncio.to_thread(ctx.phase_done, RunLayout.TAIL)) is not None:
        return done
    # without a judge a record is inferred once: nothing is rejected, a failure is final
    attempts_left = spec.max_attempts - from_round if spec.judged else 1
    if attempts_left < 1:
        raise StepOrderError(f"tail({from_round}): no attempts left (max_attempts {spec.max_attempts})")
    items, records = await asyncio.to_thread(ctx.pending_items, from_round)
    instance = await asyncio.to_thread(ctx.instance)
    families = await asyncio.to_thread(ctx.families, items)

    def make(index: int, shard: JsonlFile) -> TaskSpec:
        outputs = {"output": join(layout.tail_output, part(index)), "checkpoint": layout.tail_checkpoint(index)}
        if spec.judge_pool is not None:  # the judge's own model: each wave is judged on its pool
            outputs[JUDGE_POOL_OUTPUT] = layout.tail_judge_waves(index)
        return task_spec(ctx, from_round, "retry", index, shard.url, outputs, step=RunLayout.TAIL, instance=instance,
                         families=families, judge=spec.judge.task_config(), max_attempts=attempts_left)

    def split(index: int, result: TaskResult) -> dict[str, Any]:
        return passes.split_tail_shard(
            join(layout.tail_output, part(index)), layout.tail_approved_shard(index),
            join(layout.tail_unfinished, part(index)), storage_options=ctx.storage_options,
        )

    summary = await ctx.fanout(Phase(
        round=from_round, kind="tail", step=RunLayout.TAIL, items=items, records=records, make_task=make,
        quarantine_url=layout.tail_failed_entry, after=split,
        input_url=layout.pending(from_round), output_url=layout.tail_output,
    ), runner).run()
    await asyncio.to_thread(ctx.ledger.write, RunLayout.TAIL, {**summary.as_dict(), "from_round": from_round})
    return summary
