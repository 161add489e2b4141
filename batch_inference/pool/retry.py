"""In-place retry (Strategy 2): a retry task re-infers and re-judges each record until it is
approved or reaches ``max_attempts``.

Three objects, each owning its own state:

- ``RetryTask``: what the task's chunks share -- the request builder, the judging (on this
  worker's engine, or the judge's own pool), the checkpoint states it resumes from, the
  ``CheckpointBuffer`` and the judge lane -- and the two kinds of wave.
- ``RetryChunk``: one chunk's samples, advanced in waves until each is finished; it says
  when it first goes to judging (the next chunk's cue to start generating).
- ``run_retry``: the chunks in flight (``TAIL_CHUNKS_IN_FLIGHT`` with a judge pool, else
  one), written and flushed in input order.

The error boundary is ``pool.failures``: a record's own failure comes back per item (its
prompt, its engine item, its verdict) and is decided in the waves; nothing raised for a
wave is caught here, so it fails the task, as in an infer task, and the task's retry
resumes every record from its checkpoint. The one ``except`` is where the task ends
(``run_retry``): the chunks still in flight run to their own end (or are cancelled), so
what each reached is checkpointed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any

from batch_inference.judges import Verdict
from batch_inference.pool.constants import TAIL_CHUNKS_IN_FLIGHT
from batch_inference.pool.context import TaskContext, attempt_request, error_text, prior_attempts
from batch_inference.pool.judging import Judging, PoolJudging
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT
from batch_inference.pool.slices import give_way, map_sliced
from batch_inference.prompting import RequestBuilder
from batch_inference.rows import Status, permanent_error, strip_results
from batch_inference.storage import CheckpointStore, JsonlWriter

log = logging.getLogger(__name__)


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
        # finished records on storage, by status: the task's committed progress (its
        # progress record, what a cancel of the task still delivers)
        self.settled: dict[str, int] = {}
        self.segments = 0
        self.failures = 0
        self.last_error: str | None = None
        self._lock = asyncio.Lock()
        self._ticker: asyncio.Task[None] | None = None

    def add(self, state: dict[str, Any]) -> None:
        self.pending.append(state)

    def count_settled(self, states: Any) -> None:
        """Adds the finished ones among ``states`` (flushed, or loaded when the task resumes)."""
        for state in states:
            if (final := state.get("final")) is not None:
                status = str(final.get("status"))
                self.settled[status] = self.settled.get(status, 0) + 1

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
            self.count_settled(states)

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
class Sample:
    """One record's in-place progress within its chunk (mirrors its checkpoint state)."""

    record: dict[str, Any]
    rid: str
    base: dict[str, Any]
    prior: int
    attempt: int
    result: str | list[float] | None  # text, or an embedding's vector
    verdict: Verdict | None = None
    last_error: str | None = None  # the last attempt's retryable error (a failed batch, an engine_error)
    row: dict[str, Any] | None = None  # set once the sample is finished
    usage: dict[str, int] | None = None  # the inferred result's, carried to the approved row (as an infer row carries it)
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the inferred result, if one did
    cached: bool = False  # the inferred result came from the cross-run result cache (pool.result_cache)

    @property
    def attempts(self) -> int:
        """Its attempt number counted over every round (the request's seed and the row's ``attempts``)."""
        return self.prior + self.attempt

    def final(self, ckpt: CheckpointBuffer, final: dict[str, Any]) -> None:
        ckpt.add({"id": self.rid, "attempt": self.attempt, "last_result": self.result, "final": final})
        self.row = {**self.base, **final}

    def failed(self, ckpt: CheckpointBuffer, error: str) -> None:
        """Its own permanent failure (its prompt, its engine item), checkpointed as final like an
        approval: a task cancelled before its shard is written still delivers it as the error it is."""
        self.final(ckpt, {"result": None, "status": Status.ERROR, "error": error, "attempts": self.attempts + 1})

    def next_attempt(self, ckpt: CheckpointBuffer, last_error: str | None = None) -> None:
        """This attempt is spent (rejected, or a retryable error): its result is cleared, so a
        resumed task re-infers it, never re-judges it."""
        self.result, self.last_error = None, last_error
        self.usage = self.finish_reason = self.stop_sequence = None
        self.cached = False
        self.attempt += 1
        # states merge field by field on load: the spent attempt's usage is cleared with its result
        ckpt.add({"id": self.rid, "attempt": self.attempt, "last_result": None, "usage": None, "finish_reason": None,
                  "stop_sequence": None, "cached": False})


class RetryTask:
    """What a retry task's chunks share, and the two kinds of wave they advance by.

    ``judge_lane``: one judge wave of this task at a time, whichever chunk it is, so the
    judge pool holds at most one task per retry task in flight (its slots are sized for
    that); a chunk that finishes generating first waits here, not in a refusal.
    """

    def __init__(self, ctx: TaskContext, states: dict[str, dict[str, Any]], ckpt: CheckpointBuffer) -> None:
        spec = ctx.spec
        assert spec.infer is not None and spec.judge is not None
        self.ctx = ctx
        self.max_attempts = spec.max_attempts
        self.builder = RequestBuilder(spec.infer)
        self.judging: Judging | PoolJudging = (PoolJudging(ctx, spec.judge) if JUDGE_POOL_OUTPUT in spec.outputs
                                               else Judging(ctx, spec.judge))
        self.states = states  # id -> checkpoint state, each taken once by the sample it resumes
        self.ckpt = ckpt
        self.judge_lane = asyncio.Lock()

    @property
    def chunks_in_flight(self) -> int:
        """Two when the judge has a pool of its own (the two pools overlap), else one."""
        return TAIL_CHUNKS_IN_FLIGHT if isinstance(self.judging, PoolJudging) else 1

    def sample(self, record: dict[str, Any]) -> Sample:
        """The record resumed at its checkpointed attempt (finished: its row, at once)."""
        rid = str(record["id"])
        state = self.states.pop(rid, None) or {}
        sample = Sample(record, rid, strip_results(record), prior_attempts(record),
                        int(state.get("attempt", 0)), state.get("last_result"),
                        usage=state.get("usage"), finish_reason=state.get("finish_reason"),
                        stop_sequence=state.get("stop_sequence"), cached=bool(state.get("cached")))
        if state.get("final"):
            sample.row = {**sample.base, **state["final"]}
        return sample

    def out_of_attempts(self, s: Sample) -> None:
        s.result = None
        s.final(self.ckpt, {"result": None, "status": Status.MAX_ATTEMPTS, "error": None,
                            "attempts": s.prior + self.max_attempts,
                            "verdict": s.verdict.to_dict() if s.verdict else None,
                            **({"last_error": s.last_error} if s.last_error else {})})

    async def infer(self, wave: list[Sample]) -> None:
        """One generation for every sample of the wave (one submission)."""
        prompts = await map_sliced(lambda s: attempt_request(self.builder, s.record, s.attempts), wave)
        done = await self.ctx.generate(prompts, [s.attempts for s in wave])
        for n, (s, prompt, res) in enumerate(zip(wave, prompts, done)):
            await give_way(n)
            if isinstance(prompt, BaseException):
                s.failed(self.ckpt, error_text(prompt))
            elif isinstance(res, BaseException) or (res.error is not None and permanent_error({"error": res.error}) is None):
                # The engine raised for this record's batch, or its error is retryable
                # (engine_error, truncated_output; rows.permanent_error, the rule recompaction
                # applies between rounds): it costs this attempt (bounded by max_attempts),
                # never the record.
                s.next_attempt(self.ckpt, error_text(res) if isinstance(res, BaseException) else res.error)
            elif res.error is not None:  # permanent: every attempt would fail the same way
                s.failed(self.ckpt, res.error)
            else:
                s.result, s.last_error = list(res.embedding) if res.embedding is not None else res.text, None  # an embedding's vector
                s.usage = {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens}
                s.finish_reason = res.finish_reason
                s.stop_sequence = res.stop_sequence
                s.cached = res.from_cache
                self.ckpt.add({"id": s.rid, "attempt": s.attempt, "last_result": s.result,
                               "usage": s.usage, "finish_reason": s.finish_reason, "stop_sequence": s.stop_sequence,
                               "cached": s.cached})

    async def judge(self, wave: list[Sample]) -> None:
        """One judging call for every inferred sample of the wave, one wave of the task at a time."""
        async with self.judge_lane:
            verdicts = await self.judging.verdicts([s.record for s in wave], [s.result for s in wave],  # type: ignore[misc]
                                                   [s.attempts for s in wave])
        for s, verdict in zip(wave, verdicts):
            if verdict.approved and self.judging.escalated(verdict):
                # No round boundary here for a person to decide at: an approval the spec
                # wants reviewed does not stand on its own; the record is tried again.
                verdict = Verdict(False, f"escalated: {verdict.reason} (no review in place)", verdict.score)
            s.verdict = verdict
            if verdict.approved:
                s.final(self.ckpt, {"result": s.result, "status": Status.APPROVED, "error": None,
                                    "attempts": s.attempts + 1, "verdict": verdict.to_dict(),
                                    "usage": s.usage, "finish_reason": s.finish_reason,
                                    **({"stop_sequence": s.stop_sequence} if s.stop_sequence is not None else {}),
                                    **({"cached": True} if s.cached else {})})
            else:
                s.next_attempt(self.ckpt)


class RetryChunk:
    """One chunk of a retry task: its samples, advanced in waves until each is finished.

    ``judging`` is set at its first judge wave (or when it ends, whatever ends it): the
    cue for the next chunk to start generating on this worker's engine.
    """

    def __init__(self, task: RetryTask, records: list[dict[str, Any]]) -> None:
        self.task = task
        self.samples = [task.sample(r) for r in records]
        self.judging = asyncio.Event()

    async def run(self) -> list[dict[str, Any]]:
        """Its rows in input order, once every sample is approved, out of attempts or failed."""
        task = self.task
        try:
            while True:
                for s in self.samples:
                    if s.row is None and s.attempt >= task.max_attempts:
                        task.out_of_attempts(s)
                live = [s for s in self.samples if s.row is None]
                if not live:
                    return [s.row for s in self.samples]  # type: ignore[misc]
                if to_infer := [s for s in live if s.result is None]:
                    await task.infer(to_infer)
                if to_judge := [s for s in live if s.row is None and s.result is not None]:
                    self.judging.set()
                    await task.judge(to_judge)
        finally:
            self.judging.set()


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
    store = CheckpointStore(spec.outputs["checkpoint"], storage_options=ctx.storage_options)
    ckpt = CheckpointBuffer(store, ctx.checkpoint_interval_s)
    states = await store.load()
    ckpt.count_settled(states.values())  # finished before a resume: committed already
    task = RetryTask(ctx, states, ckpt)
    counts = {"approved": 0, "max_attempts": 0, "error": 0}

    async def write(chunk: asyncio.Task[list[dict[str, Any]]], out: JsonlWriter) -> None:
        rows = await chunk
        await ckpt.flush()
        for row in rows:
            counts[row["status"]] += 1
        await out.write_many(rows)
        await ctx.report_progress(sum(ckpt.settled.values()), ckpt.settled, committed=True)

    inflight: collections.deque[tuple[RetryChunk, asyncio.Task[list[dict[str, Any]]]]] = collections.deque()
    try:
        async with ctx.file(spec.outputs["output"]).writer() as out, ckpt:
            try:
                async for records in ctx.chunks():
                    if inflight:  # this engine is free once the chunk before is judging
                        await inflight[-1][0].judging.wait()
                    # the oldest out first (input order), as soon as done: a failure surfaces
                    # before another chunk starts
                    while inflight and (len(inflight) >= task.chunks_in_flight or inflight[0][1].done()):
                        await write(inflight.popleft()[1], out)
                    chunk = RetryChunk(task, records)
                    inflight.append((chunk, asyncio.create_task(chunk.run())))
                while inflight:
                    await write(inflight.popleft()[1], out)
            except BaseException as exc:
                # The task ends here (pool.failures): abandoned, the chunks in flight are
                # cancelled; failed, they run to their own end (a failed judge pool fails
                # them at their next judge wave), so what each reached is checkpointed for
                # the retried task. The first failure stands.
                runs = [run for _, run in inflight]
                if isinstance(exc, asyncio.CancelledError):
                    for run in runs:
                        run.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
                raise
    finally:
        if note := ckpt.failure_note():
            ctx.warnings.append(note)
    return counts
