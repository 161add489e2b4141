"""Run one pipeline step from a Dagster asset: the whole of what an asset body does.

Each asset resolves its partition to a spec (``specs.load_spec``), opens a runner from
the pool resource only when the step needs the GPU, calls the one ``PipelineRun`` step
(with the planner's ETA, ``planning.eta_after_round``, for the decisions it records) and
returns its summary as a dict. Sync on the outside (Dagster calls asset bodies
synchronously), one event loop per step on the inside.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from batch_inference.defs.pool.resources import PoolResource
    from batch_inference.pipeline import PipelineRun, PipelineSpec

T = TypeVar("T")


def _spec_errors_fail_the_step(spec: PipelineSpec, body: Awaitable[T]) -> T:
    """Run ``body``; a spec error (``SpecChanged`` on a resume, say) is the step's own failure
    message, not the cause nested under Dagster's "Error occurred while executing op"."""
    import dagster as dg

    from batch_inference.pipeline import SpecError

    try:
        return asyncio.run(body)  # type: ignore[arg-type]
    except SpecError as exc:
        raise dg.Failure(f"pipeline run {spec.run!r}: {type(exc).__name__}: {exc}") from None


def run_cpu_step(spec: PipelineSpec, step: Callable[[PipelineRun], Awaitable[T]]) -> T:
    """A step that needs no pool (shard, recompact, finalize)."""
    from batch_inference.pipeline import PipelineRun
    from batch_inference.planning.progress import eta_after_round

    return _spec_errors_fail_the_step(spec, step(PipelineRun(spec, eta=eta_after_round)))


def run_gpu_step(spec: PipelineSpec, pool: PoolResource, step: Callable[[PipelineRun], Awaitable[T]],
                 judge_pool: PoolResource | None = None) -> T:
    """A step whose shard tasks go to the pools (infer, judge, tail): ``pool`` runs the infer
    model, ``judge_pool`` a judge's own model (when the spec gives it one)."""
    from batch_inference.pipeline import PipelineRun, open_runner
    from batch_inference.planning.progress import eta_after_round

    placed = pool.apply(spec)
    if judge_pool is not None:
        placed = judge_pool.apply(placed)

    async def go() -> T:
        async with open_runner(placed) as runner:
            return await step(PipelineRun(placed, runner=runner, eta=eta_after_round))

    return _spec_errors_fail_the_step(spec, go())
