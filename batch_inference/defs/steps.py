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
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import dagster as dg

    from batch_inference.defs.pool.resources import PoolResource
    from batch_inference.pipeline import PipelineRun, PipelineSpec
    from batch_inference.pipeline.summaries import LedgerView
    from batch_inference.pool.protocol import TaskRunner

T = TypeVar("T")
Report = Callable[["LedgerView"], None]
PROGRESS_EVERY_S = 10.0  # how often a running GPU step reports its tasks' progress (log event, run tag)
PROGRESS_TAG = "batch_inference/progress"


class HostedPool:
    """The ``pool`` resource of a host that already holds the model's pool (the API server,
    sharing it fairly across batches): a GPU step of a pipeline run it hosts dispatches
    through the runner the host handed in for that run (``hosting``), without loading the
    model a second time; any other run's step reaches ``base``, as with a plain ``PoolResource``.

    The host binds it in the Definitions it executes (``shared_resources(pool=...)``): the
    runner reaches the step through Dagster's resources, not through a module's global.
    """

    def __init__(self, base: PoolResource) -> None:
        self.base = base
        self._runners: dict[str, TaskRunner] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hosting(self, run: str, runner: TaskRunner) -> Iterator[None]:
        """While open, the GPU steps of pipeline run ``run`` dispatch through ``runner``."""
        with self._lock:
            self._runners[run] = runner
        try:
            yield
        finally:
            with self._lock:
                if self._runners.get(run) is runner:
                    del self._runners[run]

    def runner_for(self, run: str) -> TaskRunner | None:
        with self._lock:
            return self._runners.get(run)

    def apply(self, spec: PipelineSpec) -> PipelineSpec:
        return self.base.apply(spec)

    def describe(self, spec: PipelineSpec) -> dict[str, Any]:
        return self.base.describe(spec)


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
    from batch_inference.review.lifecycle import ReviewGate

    return _spec_errors_fail_the_step(spec, step(PipelineRun(spec, eta=eta_after_round, gate=ReviewGate())))


def progress_reporter(context: dg.AssetExecutionContext) -> Report:
    """What a running GPU step shows in Dagster while its tasks run (``run_gpu_step``'s ``report``):
    a log event each time its progress moves, and the run tag ``batch_inference/progress`` with the
    latest (the runs list shows it), from the tasks' per-chunk progress records (``LedgerView.steps``)."""
    last: list[str] = []

    def report(view: LedgerView) -> None:
        from batch_inference.pipeline.report import step_lines

        lines = step_lines(view)
        if not lines or lines == last:
            return
        last[:] = lines
        context.log.info("; ".join(lines))
        try:
            context.instance.add_run_tags(context.run_id, {PROGRESS_TAG: lines[-1]})
        except Exception as exc:  # noqa: BLE001 - a figure on the run list, never the step's failure
            context.log.warning(f"progress tag not set: {type(exc).__name__}: {exc}")

    return report


async def _reported(run: PipelineRun, body: Awaitable[T], report: Report | None) -> T:
    """``body``, with ``report`` given the run's ledger view every ``PROGRESS_EVERY_S`` while it runs."""
    if report is None:
        return await body

    async def watch() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            try:
                report(await asyncio.to_thread(run.ledger.view))
            except Exception:  # noqa: BLE001 - progress is a figure: a failed read waits for the next
                continue

    watcher = asyncio.create_task(watch())
    try:
        return await body
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


def run_gpu_step(spec: PipelineSpec, pool: PoolResource | HostedPool, step: Callable[[PipelineRun], Awaitable[T]],
                 judge_pool: PoolResource | None = None, *, report: Report | None = None) -> T:
    """A step whose shard tasks go to the pools (infer, judge, tail): ``pool`` runs the infer
    model, ``judge_pool`` a judge's own model (when the spec gives it one); a ``HostedPool``
    hosting the spec's run hands its runner in instead. ``report`` gets
    the run's ledger view every ``PROGRESS_EVERY_S`` while the step runs (``progress_reporter``)."""
    from batch_inference.pipeline import PipelineRun, open_runner
    from batch_inference.planning.progress import eta_after_round
    from batch_inference.review.lifecycle import ReviewGate

    hosted = pool.runner_for(spec.run) if isinstance(pool, HostedPool) else None
    if hosted is not None:
        run = PipelineRun(spec, runner=hosted, eta=eta_after_round, gate=ReviewGate())
        return _spec_errors_fail_the_step(spec, _reported(run, step(run), report))
    placed = pool.apply(spec)
    if judge_pool is not None:
        placed = judge_pool.apply(placed)

    async def go() -> T:
        async with open_runner(placed) as runner:
            run = PipelineRun(placed, runner=runner, eta=eta_after_round, gate=ReviewGate())
            return await _reported(run, step(run), report)

    return _spec_errors_fail_the_step(spec, go())
