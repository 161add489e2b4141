"""Run one pipeline step from a Dagster asset: the whole of what an asset body does.

Each asset resolves its partition to a spec (``specs.load_spec``), opens a runner from
the pool resource only when the step needs the GPU, calls the one ``PipelineRun`` step
(with the planner's ETA, ``planning.eta_after_round``, for the decisions it records) and
returns its summary as a dict. Sync on the outside (Dagster calls asset bodies
synchronously), one event loop per step on the inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from batch_inference.defs.pool.resources import PoolResource
    from batch_inference.pipeline import PipelineRun, PipelineSpec
    from batch_inference.pool.protocol import TaskRunner

T = TypeVar("T")

_HOSTED: dict[str, TaskRunner] = {}
_HOSTED_LOCK = threading.Lock()


@contextlib.contextmanager
def hosted_runner(run: str, runner: TaskRunner) -> Iterator[None]:
    """While open, the GPU steps of pipeline run ``run`` executed in this process dispatch
    through ``runner`` instead of opening one from the pool resource: a host that already
    holds the model's pool (the API server, sharing it fairly across batches) runs the steps
    as Dagster runs without loading the model a second time."""
    with _HOSTED_LOCK:
        _HOSTED[run] = runner
    try:
        yield
    finally:
        with _HOSTED_LOCK:
            if _HOSTED.get(run) is runner:
                del _HOSTED[run]


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

    with _HOSTED_LOCK:
        hosted = _HOSTED.get(spec.run)
    if hosted is not None:
        return _spec_errors_fail_the_step(spec, step(PipelineRun(spec, runner=hosted, eta=eta_after_round)))
    placed = pool.apply(spec)
    if judge_pool is not None:
        placed = judge_pool.apply(placed)

    async def go() -> T:
        async with open_runner(placed) as runner:
            return await step(PipelineRun(placed, runner=runner, eta=eta_after_round))

    return _spec_errors_fail_the_step(spec, go())
