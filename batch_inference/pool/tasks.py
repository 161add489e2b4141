"""The shard tasks a worker runs: infer, judge and retry (docs/ARCHITECTURE.md "Shard tasks").

Every task streams its input shard in ``chunk_size`` chunks, submits each chunk's prompts
to the worker's ONE engine host (its shared batcher merges records of all concurrent
tasks into full batches; a streaming engine's gate lets them flow straight in), gathers with ``return_exceptions=True`` so one bad record never fails the
shard, and writes one output shard per output key through the storage layer's atomic
writer: a retried task rewrites its whole output, and a killed one leaves none.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from batch_inference import rows
from batch_inference.engines import Completion
from batch_inference.judges import Verdict
from batch_inference.pool.context import (
    TaskContext,
    TaskInputError,
    TaskMeter,
    attempt_request,
    error_text,
    prior_attempts,
)
from batch_inference.pool.failures import JudgePoolError
from batch_inference.pool.judging import Judging, PoolJudging
from batch_inference.pool.protocol import (
    JUDGE_POOL_OUTPUT,
    PERMANENT_ERRORS,
    REVIEW_OUTPUT,
)
from batch_inference.prompting import RequestBuilder
from batch_inference.rows import ErrorKind, Status, permanent_error, strip_results
from batch_inference.storage import CheckpointStore

log = logging.getLogger(__name__)


async def run_infer(ctx: TaskContext) -> dict[str, int]:
    """One output row per input record: ``result`` or ``error``, usage, attempts + 1."""
    spec = ctx.spec
    assert spec.infer is not None
    builder = RequestBuilder(spec.infer)
    counts = {"ok": 0, "error": 0}
    async with ctx.file(spec.outputs["output"]).writer() as out:
        async for chunk in ctx.chunks():
            prior = [prior_attempts(r) for r in chunk]
            results = await ctx.generate([attempt_request(builder, r, n) for r, n in zip(chunk, prior)], prior)
            rows = []
            for record, n, res in zip(chunk, prior, results):
                row = {**strip_results(record), "attempts": n + 1}
                if isinstance(res, Completion) and res.error is None:
                    row.update(result=res.text, error=None, finish_reason=res.finish_reason,
                               usage={"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens})
                    counts["ok"] += 1
                else:
                    error = res.error if isinstance(res, Completion) else error_text(res)
                    usage = {"prompt_tokens": res.prompt_tokens if isinstance(res, Completion) else 0, "completion_tokens": 0}
                    row.update(result=None, error=error, finish_reason="error", usage=usage)
                    counts["error"] += 1
                rows.append(row)
            await out.write_many(rows)
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
            ok = [r for r in chunk if r.get("error") is None and isinstance(r.get("result"), str)]
            verdicts = await judging.verdicts(ok, [r["result"] for r in ok], [prior_attempts(r) for r in ok])
            by_id = {id(r): v for r, v in zip(ok, verdicts)}
            yes, no, ask = [], [], []
            for row in chunk:
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
    return counts


# --------------------------------------------------------------------------- retry (Strategy 2)


class CheckpointBuffer:
    """Per-attempt states, appended to the CheckpointStore as one segment per flush.

    Flushed at the end of every chunk and every ``interval_s`` in between (so an eviction
    mid-chunk loses at most that much progress) -- never one write per sample. A failed
    periodic flush is logged and keeps its states for the next one; the ticker goes on,
    and ``failure_note()`` reports the failures for the task's result.
    """

    def __init__(self, store: CheckpointStore, interval_s: float) -> None:
        self.store = store
        self.interval_s = interval_s
        self.pending: list[dict[str, Any]] = []
        self.segments = 0
        self.failures = 0
        self.last_error: str | None = None
        self._lock = asyncio.Lock()
        self._ticker: asyncio.Task[None] | None = None

    def add(self, state: dict[str, Any]) -> None:
        self.pending.append(state)

    async def flush(self) -> None:
        async with self._lock:
            if not self.pending:
                return
            states, self.pending = self.pending, []
            try:
                await self.store.append(states)
            except BaseException:
                self.pending = states + self.pending  # nothing lost: the next flush retries them
                raise
            self.segments += 1

    async def __aenter__(self) -> CheckpointBuffer:
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        try:
            await self.flush()  # also on failure or abandonment: keep the progress made
        except Exception as exc:
            self._failed(exc)
            log.exception("final checkpoint flush failed for %s", self.store)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except Exception as exc:  # e.g. storage briefly down: keep ticking, say so
                self._failed(exc)
                log.warning("periodic checkpoint flush failed for %s (%d so far): %s", self.store.url, self.failures, exc)

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def failure_note(self) -> str | None:
        """What the task reports when any flush failed (None when none did)."""
        if not self.failures:
            return None
        still = f"; {len(self.pending)} state(s) never written" if self.pending else "; all states written later"
        return f"checkpoint flush failed {self.failures} time(s) ({self.last_error}){still}"


@dataclass
class _Sample:
    """One record's in-place progress within its chunk (mirrors its checkpoint state)."""

    record: dict[str, Any]
    rid: str
    base: dict[str, Any]
    prior: int
    attempt: int
    result: str | None
    verdict: Verdict | None = None
    last_error: str | None = None  # the last attempt's retryable error (a failed batch, an engine_error)
    row: dict[str, Any] | None = None  # set once the sample is finished

    def final(self, ckpt: CheckpointBuffer, final: dict[str, Any]) -> None:
        ckpt.add({"id": self.rid, "attempt": self.attempt, "last_result": self.result, "final": final})
        self.row = {**self.base, **final}

    def error(self, text: str) -> None:
        """This record's own failure (prompt, engine item, judge), not checkpointed: a resumed task takes the record up at its last checkpoint."""
        self.row = {**self.base, "result": None, "status": Status.ERROR, "error": text, "attempts": self.prior + self.attempt + 1}


# A retry task whose judge has its own pool keeps this many chunks in flight (run_retry):
# the next chunk generates here while the one before it is judged on the judge pool, so
# the two pools work at once instead of taking turns, and every wave keeps its chunk's
# size (splitting a chunk instead halves the waves, whose per-batch cost then ate the
# gain: bench/reports/judge_model.md). Bounded: at most this many chunks' samples live.
TAIL_CHUNKS_IN_FLIGHT = 2


async def run_retry(ctx: TaskContext) -> dict[str, int]:
    """In-place retry: each record is re-inferred and re-judged until approved or max_attempts.

    A chunk advances in waves: every sample that needs inference is submitted in one
    ``generate`` call (one tokenizer pass, one ``submit_many``), then every sample with
    a result is judged in one call, so the per-sample cost equals a round's. When the
    judge has a pool of its own, ``TAIL_CHUNKS_IN_FLIGHT`` chunks advance at once, each
    starting once the one before it goes to judging: while one chunk is judged on the
    judge pool the next generates on this engine, so the two pools work at once instead
    of taking turns (one judge wave of the task in the judge pool at a time). Chunks are
    written, and their checkpoints flushed, in input order, once per chunk. A record's
    state is checkpointed per attempt, so a task retried after an eviction resumes every
    record at the attempt it was on: a result already inferred but not yet judged is
    judged (not re-inferred), one already rejected is re-inferred (never re-judged), and
    a finished record is written from its checkpoint without any work.
    """
    spec = ctx.spec
    assert spec.infer is not None and spec.judge is not None
    builder = RequestBuilder(spec.infer)
    judging = PoolJudging(ctx, spec.judge) if JUDGE_POOL_OUTPUT in spec.outputs else Judging(ctx, spec.judge)
    store = CheckpointStore(spec.outputs["checkpoint"], storage_options=ctx.storage_options)
    states = await store.load()
    counts = {"approved": 0, "max_attempts": 0, "error": 0}

    def start(record: dict[str, Any]) -> _Sample:
        rid = str(record["id"])
        state = states.pop(rid, None) or {}
        sample = _Sample(record, rid, strip_results(record), prior_attempts(record),
                         int(state.get("attempt", 0)), state.get("last_result"))
        if state.get("final"):
            sample.row = {**sample.base, **state["final"]}
        return sample

    async def infer_wave(wave: list[_Sample], ckpt: CheckpointBuffer) -> None:
        prompts = [attempt_request(builder, s.record, s.prior + s.attempt) for s in wave]
        # what is raised for the wave (a dead engine, a tokenizer that fails the batch) fails the
        # task, as in an infer task (pool.failures); a record's own failure comes back per item
        done = await ctx.generate(prompts, [s.prior + s.attempt for s in wave])
        for s, prompt, res in zip(wave, prompts, done):
            if isinstance(prompt, BaseException):
                s.error(error_text(prompt))
            elif isinstance(res, BaseException) or (res.error is not None and permanent_error({"error": res.error}) is None):
                # The engine raised for the whole batch, or this record's error is retryable
                # (engine_error, truncated_output; rows.permanent_error, the rule recompaction
                # applies between rounds): it costs this attempt (bounded by max_attempts),
                # never the record.
                s.last_error = error_text(res) if isinstance(res, BaseException) else res.error
                s.attempt += 1
                ckpt.add({"id": s.rid, "attempt": s.attempt, "last_result": None})
            elif res.error is not None:  # permanent: every attempt would fail the same way
                s.row = {**s.base, "result": None, "status": Status.ERROR, "error": res.error, "attempts": s.prior + s.attempt + 1}
            else:
                s.result, s.last_error = res.text, None
                ckpt.add({"id": s.rid, "attempt": s.attempt, "last_result": s.result})

    async def judge_wave(wave: list[_Sample], ckpt: CheckpointBuffer) -> None:
        # A record's own failure comes back as its verdict (a judge_error rejection); anything
        # raised for the wave (the engine or the judge pool gone, its disk full, a task id held
        # with another spec, the wave's files unwritable) is the infrastructure's: the task fails
        # with it as an infer task does, and a retried task resumes from the checkpoints.
        verdicts = await judging.verdicts([s.record for s in wave], [s.result for s in wave],  # type: ignore[misc]
                                          [s.prior + s.attempt for s in wave])
        for s, verdict in zip(wave, verdicts):
            if verdict.approved and judging.escalated(verdict):
                # No round boundary here for a person to decide at: an approval the spec
                # wants reviewed does not stand on its own; the record is tried again.
                verdict = Verdict(False, f"escalated: {verdict.reason} (no review in place)", verdict.score)
            s.verdict = verdict
            if verdict.approved:
                s.final(ckpt, {"result": s.result, "status": Status.APPROVED, "error": None,
                               "attempts": s.prior + s.attempt + 1, "verdict": verdict.to_dict()})
            else:
                # Clear the result: on resume this attempt is re-inferred, never re-judged.
                s.result = None
                s.attempt += 1
                ckpt.add({"id": s.rid, "attempt": s.attempt, "last_result": None})

    # One judge wave of this task at a time, whichever chunk it is: the judge pool holds at
    # most one task per retry task in flight, as when the waves took turns (its slots are
    # sized for that); a chunk that finishes generating first waits here, not in a refusal.
    judge_lane = asyncio.Lock()

    async def process(chunk: list[dict[str, Any]], ckpt: CheckpointBuffer, judging_starts: asyncio.Event) -> list[dict[str, Any]]:
        """Waves over the chunk until each sample is finished; ``judging_starts`` is set at the
        first judge wave (or at the end, whatever ends the loop): the next chunk's cue."""
        samples = [start(r) for r in chunk]
        try:
            while True:
                for s in samples:
                    if s.row is None and s.attempt >= spec.max_attempts:
                        s.result = None
                        s.final(ckpt, {"result": None, "status": Status.MAX_ATTEMPTS, "error": None,
                                       "attempts": s.prior + spec.max_attempts,
                                       "verdict": s.verdict.to_dict() if s.verdict else None,
                                       **({"last_error": s.last_error} if s.last_error else {})})
                live = [s for s in samples if s.row is None]
                if not live:
                    return [s.row for s in samples]  # type: ignore[misc]
                to_infer = [s for s in live if s.result is None]
                if to_infer:
                    await infer_wave(to_infer, ckpt)
                to_judge = [s for s in live if s.row is None and s.result is not None]
                if to_judge:
                    judging_starts.set()
                    async with judge_lane:
                        await judge_wave(to_judge, ckpt)
        finally:
            judging_starts.set()

    async def chunk_done(ckpt: CheckpointBuffer, run: asyncio.Task[list[dict[str, Any]]], out: Any) -> None:
        rows = await run
        await ckpt.flush()
        for row in rows:
            counts[row["status"]] += 1
        await out.write_many(rows)

    ahead = TAIL_CHUNKS_IN_FLIGHT if isinstance(judging, PoolJudging) else 1
    ckpt = CheckpointBuffer(store, ctx.checkpoint_interval_s)
    inflight: collections.deque[tuple[asyncio.Task[list[dict[str, Any]]], asyncio.Event]] = collections.deque()
    try:
        async with ctx.file(spec.outputs["output"]).writer() as out, ckpt:
            try:
                async for chunk in ctx.chunks():
                    if inflight:  # this engine is free once the chunk before is judging
                        await inflight[-1][1].wait()
                    # the oldest out first (input order), as soon as done: a failure surfaces
                    # before another chunk starts
                    while inflight and (len(inflight) >= ahead or inflight[0][0].done()):
                        await chunk_done(ckpt, inflight.popleft()[0], out)
                    cue = asyncio.Event()
                    inflight.append((asyncio.create_task(process(chunk, ckpt, cue)), cue))
                while inflight:
                    await chunk_done(ckpt, inflight.popleft()[0], out)
            except BaseException as exc:
                # Abandoned: the chunks in flight are cancelled. Failed: they run to their own
                # end (a failed judge pool fails them at their next judge wave), so what each
                # reached is checkpointed for the retried task; the first failure stands.
                runs = [run for run, _ in inflight]
                if isinstance(exc, asyncio.CancelledError):
                    for run in runs:
                        run.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
                raise
    finally:
        if note := ckpt.failure_note():
            ctx.warnings.append(note)
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
