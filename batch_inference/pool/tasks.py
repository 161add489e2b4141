"""The shard tasks a worker runs: infer, judge and retry (``pool.retry``; docs/ARCHITECTURE.md "Shard tasks").

Every task streams its input shard in ``chunk_size`` chunks, submits each chunk's prompts
to the worker's ONE engine host (its shared batcher merges records of all concurrent
tasks into full batches; a streaming engine's gate lets them flow straight in), gathers with ``return_exceptions=True`` so one bad record never fails the
shard, and writes one output shard per output key through the storage layer's atomic
writer: a retried task rewrites its whole output, and a killed one leaves none.
"""

from __future__ import annotations

import contextlib

from batch_inference import rows
from batch_inference.engines import Completion
from batch_inference.pool.context import (
    TaskContext,
    TaskInputError,
    TaskMeter,
    attempt_request,
    error_text,
    prior_attempts,
)
from batch_inference.pool.failures import JudgePoolError
from batch_inference.pool.judging import Judging
from batch_inference.pool.protocol import (
    PERMANENT_ERRORS,
    REVIEW_OUTPUT,
)
from batch_inference.pool.retry import run_retry
from batch_inference.pool.slices import give_way, map_sliced
from batch_inference.prompting import RequestBuilder
from batch_inference.rows import ErrorKind, Status, strip_results

async def run_infer(ctx: TaskContext) -> dict[str, int]:
    """One output row per input record: ``result`` or ``error``, usage, attempts + 1."""
    spec = ctx.spec
    assert spec.infer is not None
    builder = RequestBuilder(spec.infer)
    counts = {"ok": 0, "error": 0}
    async with ctx.file(spec.outputs["output"]).writer() as out:
        async for chunk in ctx.chunks():
            prior = [prior_attempts(r) for r in chunk]
            requests = await map_sliced(lambda rn: attempt_request(builder, *rn), list(zip(chunk, prior)))
            results = await ctx.generate(requests, prior)
            rows = []
            for record, n, res in zip(chunk, prior, results):
                await give_way(len(rows))
                row = {**strip_results(record), "attempts": n + 1}
                if isinstance(res, Completion) and res.error is None:
                    result = list(res.embedding) if res.embedding is not None else res.text  # an embedding's vector
                    row.update(result=result, error=None, finish_reason=res.finish_reason,
                               usage={"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens})
                    if res.from_cache:  # answered from an earlier run's identical request (pool.result_cache)
                        row["cached"] = True
                    if res.stop_sequence is not None:  # which stop string ended it (Anthropic's stop_sequence)
                        row["stop_sequence"] = res.stop_sequence
                    counts["ok"] += 1
                else:
                    error = res.error if isinstance(res, Completion) else error_text(res)
                    usage = {"prompt_tokens": res.prompt_tokens if isinstance(res, Completion) else 0, "completion_tokens": 0}
                    row.update(result=None, error=error, finish_reason="error", usage=usage)
                    counts["error"] += 1
                rows.append(row)
            await out.write_many(rows)
            await ctx.report_progress(counts["ok"] + counts["error"], counts, committed=False)
    return counts


# --------------------------------------------------------------------------- judge


async def run_judge(ctx: TaskContext) -> dict[str, int]:
    """Split inferred rows into approved and rejected (and, when people review, the queue).

    Inference errors skip the judge (rejected: the next round retries them, no person
    needed; those with a permanent error are counted apart, ``PERMANENT_ERRORS``); a verdict the spec escalates, or every row for a human judge, goes to the
    ``review`` output with the automated verdict beside it.
    """
    spec = ctx.spec
    assert spec.judge is not None
    judging = Judging(ctx, spec.judge)
    counts = {"approved": 0, "rejected": 0, PERMANENT_ERRORS: 0}
    review_url = spec.outputs.get(REVIEW_OUTPUT)
    if review_url is not None:
        counts["review"] = 0
    async with contextlib.AsyncExitStack() as stack:
        approved = await stack.enter_async_context(ctx.file(spec.outputs["approved"]).writer())
        rejected = await stack.enter_async_context(ctx.file(spec.outputs["rejected"]).writer())
        review = await stack.enter_async_context(ctx.file(review_url).writer()) if review_url else None
        async for chunk in ctx.chunks():
            # a result is text, or an embedding's vector (judged by kind none only: the spec refuses other judges)
            ok = [r for r in chunk if r.get("error") is None and isinstance(r.get("result"), (str, list))]
            verdicts = await judging.verdicts(ok, [r["result"] for r in ok], [prior_attempts(r) for r in ok])
            by_id = {id(r): v for r, v in zip(ok, verdicts)}
            yes, no, ask = [], [], []
            for n, row in enumerate(chunk):
                await give_way(n)
                verdict = by_id.get(id(row))
                if verdict is None:
                    reason = ErrorKind.INFERENCE_ERROR.tag(row.get("error") or "no result")
                    no.append({**row, "rejection": reason, "verdict": None})
                elif review is not None and judging.escalated(verdict):
                    ask.append({**row, "status": rows.Status.AWAITING_REVIEW.value, "verdict": verdict.to_dict(), "round": spec.round})
                elif verdict.approved:
                    base = {k: v for k, v in row.items() if k != "rejection"}
                    yes.append({**base, "status": Status.APPROVED, "verdict": verdict.to_dict(), "round": spec.round})
                else:
                    no.append({**row, "rejection": verdict.reason, "verdict": verdict.to_dict()})
            await approved.write_many(yes)
            await rejected.write_many(no)
            counts["approved"] += len(yes)
            counts["rejected"] += len(no)
            counts[PERMANENT_ERRORS] += sum(1 for row in no if rows.permanent_error(row) is not None)
            if review is not None:
                await review.write_many(ask)
                counts["review"] += len(ask)
            await ctx.report_progress(ctx.meter.records_in, counts, committed=False)
    return counts


RUNNERS = {"infer": run_infer, "judge": run_judge, "retry": run_retry}


async def run_task(ctx: TaskContext) -> dict[str, int]:
    """Run the task ``ctx.spec`` names; returns its counts (``schema_invalid``: its completions,
    inference or judge, that failed their response format, when any did)."""
    counts = await RUNNERS[ctx.spec.kind](ctx)
    if ctx.schema_invalid:
        counts[ErrorKind.SCHEMA_INVALID.value] = ctx.schema_invalid
    return counts


__all__ = ["JudgePoolError", "TaskContext", "TaskInputError", "TaskMeter", "run_task"]
