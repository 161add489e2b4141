"""The driving loop: a whole run, step after step, resumed after transient errors.

``drive`` calls ``PipelineRun``'s steps in the order the strategy needs; every step
resumes, so running it again is the resume path. ``run_pipeline`` proves the spec first
(``preflight``), opens a runner from ``spec.pool`` when none is given (the shard step
runs while it opens: ``shard_while_opening``), rides out transient storage errors
(``drive_retrying``), and writes the exports the spec asks for (``export``: Parquet,
OpenAI Batch files) once the run has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from batch_inference.pipeline.fanout import Reporter
from batch_inference.pipeline.gate import RoundGate
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.run import EtaEstimate, PipelineRun
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.summaries import RunSummary
from batch_inference.pipeline.transient import is_transient
from batch_inference.pool.protocol import TaskRunner

log = logging.getLogger(__name__)

__all__ = ["drive", "drive_retrying", "run_pipeline", "shard_while_opening", "write_exports"]


async def drive(run: PipelineRun) -> RunSummary:
    """Call the steps in sequence; every step resumes, so this is also the resume path.
    Round 0's infer phase starts beside the shard step when its layout pass streams shards
    (``PipelineRun.shard_and_infer_first``)."""
    if run.spec.strategy == "in_place":
        await run.shard()
        await run.tail(0)
        return await run.finalize()
    await run.shard_and_infer_first()
    r = 0
    while True:
        await run.infer(r)
        await run.judge(r)
        if await asyncio.to_thread(run.needs_review, r):
            await run.wait_for_review(r)
        decision = await asyncio.to_thread(run.decide, r)
        if (decided := getattr(run.reporter, "round_decided", None)) is not None:
            decided(r, decision.kind, decision.figures)
        if decision.kind == "next_round":
            await run.recompact(r)
            r += 1
            continue
        if decision.kind == "tail":
            await run.recompact(r)
            await run.tail(r + 1)
        break
    return await run.finalize()


async def drive_retrying(run: PipelineRun, *, retries: int = 5, backoff_s: float = 1.0) -> RunSummary:
    """``drive``, resumed after a transient storage/network error (steps are idempotent).

    Waits ``backoff_s``, doubling, up to ``retries`` times (defaults ride out ~30 s of
    object-store outage), then lets the error through: the run stops, a re-run resumes.
    """
    for attempt in range(retries + 1):
        try:
            return await drive(run)
        except Exception as exc:
            if attempt >= retries or not is_transient(exc):
                raise
            wait = backoff_s * 2**attempt
            log.warning("run %s: transient error (%s: %s); resuming in %.1fs (%d/%d)",
                        run.spec.run, type(exc).__name__, exc, wait, attempt + 1, retries)
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


async def run_pipeline(
    spec: PipelineSpec, *, runner: TaskRunner | None = None, reporter: Reporter | None = None,
    retries: int = 5, backoff_s: float = 1.0, eta: EtaEstimate | None = None, gate: RoundGate | None = None,
) -> RunSummary:
    """Run (or resume) a whole pipeline; opens a runner from ``spec.pool`` when none is given.

    Transient storage errors resume the run after a backoff (``retries``, ``backoff_s``);
    ``eta`` adds the run's ETA to each round's decision (``PipelineRun``); ``gate`` is where a
    round waits for people (``pipeline.gate``: the CLI and the API pass ``review.ReviewGate()``).
    The spec is proven first (``preflight``: judge built, the first records rendered
    through infer and judge), so a spec error stops the run before the pool spends anything.
    """
    from batch_inference.pipeline.preflight import preflight

    probe = PipelineRun(spec)
    resumed = await asyncio.to_thread(lambda: probe.ledger.read(RunLayout.SHARD) is not None and probe.ctx.dir(probe.layout.sharded).manifest() is not None)
    await asyncio.to_thread(preflight, spec, sharded=probe.layout.sharded if resumed else None)
    if runner is not None:
        run = PipelineRun(spec, runner, reporter=reporter, eta=eta, stream_round0=True, gate=gate)
        summary = await drive_retrying(run, retries=retries, backoff_s=backoff_s)
    else:
        run = PipelineRun(spec, reporter=reporter, eta=eta, stream_round0=True, gate=gate)
        async with shard_while_opening(run) as opened:
            run.runner = opened
            summary = await drive_retrying(run, retries=retries, backoff_s=backoff_s)
    await asyncio.to_thread(write_exports, probe)
    return summary


@contextlib.asynccontextmanager
async def shard_while_opening(run: PipelineRun) -> AsyncIterator[TaskRunner]:
    """``open_runner(run.spec)``, with the run's shard step (reshard and layout pass, CPU on
    the driver) running while the pool starts (workers spawning, models loading), so a run
    pays the longer of the two rather than their sum. When the layout pass streams its shards
    (``PipelineRun.stream_round0``), the runner is handed over as soon as it is open, and round 0
    starts on them while the pass still writes.

    A shard step that fails for good while the pool is still opening stops the opening and
    fails the run with its own error at once (bad input is not reported a pool start later);
    its other errors are left to ``drive``, which calls ``shard()`` again: a finished step
    resumes at once, a transient error is retried as it always is. A pool that fails to open
    fails the run with its own error, once the shard step has stopped writing (its thread
    cannot be cancelled; a re-run resumes what it finished).
    """
    from batch_inference.pipeline.runner import open_runner

    opener = asyncio.current_task()
    assert opener is not None
    opening = True
    failed: list[BaseException] = []

    def stop_opening(task: asyncio.Task[object]) -> None:
        if opening and not task.cancelled() and (exc := task.exception()) is not None and not is_transient(exc):
            failed.append(exc)
            opener.cancel()

    sharding = run.start_shard()
    sharding.add_done_callback(stop_opening)
    try:
        async with open_runner(run.spec) as opened:
            opening = False
            if not run.streams_round0:  # else round 0 starts on the layout pass's first shards (drive)
                with contextlib.suppress(Exception):
                    await sharding
            yield opened
    except asyncio.CancelledError:
        if failed and opener.uncancel() == 0:  # our cancel, nobody else's: the shard step's error
            raise failed[0] from None
        raise
    finally:  # a step still writing is waited for; a failed one's error is drive's to raise
        opening = False
        with contextlib.suppress(BaseException):
            await asyncio.shield(sharding)


def write_exports(run: PipelineRun) -> list[str]:
    """The exports the spec asks for (``export``) of a finished run, each where
    ``batch-inference export`` writes it; returns their URLs (blocking)."""
    from batch_inference.pipeline.export import export_openai_batch
    from batch_inference.pipeline.parquet_export import export_parquet

    written = []
    for fmt in run.spec.export:
        if fmt == "parquet":
            written.append(export_parquet(run).out_url)
        else:
            written.append(export_openai_batch(run).output_url)
    return written
