"""The shard tasks a worker runs: infer, judge and retry (docs/ARCHITECTURE.md "Shard tasks").

Every task streams its input shard in ``chunk_size`` chunks, submits each chunk's prompts
to the worker's ONE engine host (its shared batcher merges records of all concurrent
tasks into full batches; a streaming engine's gate lets them flow straight in), gathers with ``return_exceptions=True`` so one bad record never fails the
shard, and writes one output shard per output key through the storage layer's atomic
writer: a retried task rewrites its whole output, and a killed one leaves none.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from batch_inference import rows
from batch_inference.engines import (
    Completion,
    EngineDeadError,
    SamplingParams,
    Tokens,
    greedy_ignores_seed,
    prefix_block_size,
    supports_structured_output,
)
from batch_inference.engines.blocks import BLOCK_HASH_BYTES, DistinctBlocks
from batch_inference.engines.base import unconstrained_error
from batch_inference.engines.structured import format_error
from batch_inference.judges import JudgeConfig, LLMJudge, Verdict, build_judge
from batch_inference.pool.dedup import Orphaned, request_key
from batch_inference.pool.engine_host import EngineHost
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT, PERMANENT_ERRORS, REVIEW_OUTPUT, TaskFailed, TaskRunner, TaskSpec
from batch_inference.pool.request import GenRequest
from batch_inference.prompting import Request, RequestBuilder, RequestError
from batch_inference.prompting.prefix import prompt_order_key
from batch_inference.rows import ErrorKind, Status, permanent_error
from batch_inference.storage import CheckpointStore, JsonlFile, urls

log = logging.getLogger(__name__)

# The automated "verdict" of a human judge: nothing decided yet.
HUMAN_REVIEW = "human_review"


class TaskInputError(ValueError):
    """The task's input is unusable as a whole (retrying cannot help): the worker answers 422."""


class JudgePoolError(RuntimeError):
    """The judge pool could not judge a retry task's wave: the task fails as a whole (its
    checkpoints keep every record's progress), never a record."""


@dataclass
class TaskMeter:
    """Token and engine-time accounting for one task (its share of shared batches)."""

    records_in: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    engine_s: float = 0.0
    fill_sum: float = 0.0
    requests: int = 0
    duplicates: int = 0  # answered by an identical request (pool.dedup): no engine work
    duplicate_tokens_in: int = 0
    duplicate_tokens_out: int = 0
    # the engine's prefix cache over this task's requests (those whose completion says):
    # prompt tokens looked up, and those it found cached
    prefix_queried: int = 0
    prefix_hits: int = 0
    # the ideal (each distinct prefix computed once): the distinct cacheable blocks of the
    # requests the engine ran (a sketch the driver merges over the phase) and their tokens
    # past those blocks, which every request computes
    prefix_blocks: DistinctBlocks | None = None
    prefix_tail_tokens: int = 0

    def sign(self, tokens: list[Tokens | Completion], signature: Any, block_size: int) -> None:
        """Adds the encoded requests' blocks to the phase's ideal (blocking: off the event loop)."""
        if self.prefix_blocks is None:
            self.prefix_blocks = DistinctBlocks()
        for t in tokens:
            if isinstance(t, Tokens):
                blocks = signature(t)
                self.prefix_blocks.add(blocks)
                self.prefix_tail_tokens += len(t.ids) - len(blocks) // BLOCK_HASH_BYTES * block_size

    def add(self, request: GenRequest, completion: Completion) -> None:
        self.tokens_in += completion.prompt_tokens
        self.tokens_out += completion.completion_tokens
        self.engine_s += request.engine_s
        self.fill_sum += request.fill
        self.requests += 1
        if completion.cached_tokens is not None:
            self.prefix_queried += completion.prompt_tokens
            self.prefix_hits += completion.cached_tokens

    def add_duplicate(self, completion: Completion) -> None:
        """Its tokens count as the task's (its row carries them); the engine computed none."""
        self.tokens_in += completion.prompt_tokens
        self.tokens_out += completion.completion_tokens
        self.duplicates += 1
        self.duplicate_tokens_in += completion.prompt_tokens
        self.duplicate_tokens_out += completion.completion_tokens

    @property
    def avg_fill(self) -> float:
        """Fill of the batches this task's requests rode in, weighted per request."""
        return self.fill_sum / self.requests if self.requests else 0.0


@dataclass
class TaskContext:
    """What one running task needs: its spec, the worker's engine host, storage options."""

    spec: TaskSpec
    host: EngineHost
    storage_options: dict[str, Any] | None = None
    checkpoint_interval_s: float = 5.0
    judge_runner: TaskRunner | None = None  # the worker's judge pool (retry tasks with a judge_pool output)
    meter: TaskMeter = field(default_factory=TaskMeter)
    warnings: list[str] = field(default_factory=list)  # reported in TaskResult.warnings
    schema_invalid: int = 0  # constrained completions that failed their format (counted in the task's counts)

    def file(self, url: str) -> JsonlFile:
        return JsonlFile(url, storage_options=self.storage_options)

    async def chunks(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The input shard in ``chunk_size`` chunks; checks every record has an id."""
        src = self.file(self.spec.input_url)
        chunk: list[dict[str, Any]] = []
        async for record in src.iter_records():
            self.meter.records_in += 1
            if not isinstance(record, dict) or "id" not in record:
                raise TaskInputError(f"{src.url}: record {self.meter.records_in} has no 'id' (ids are assigned at sharding)")
            chunk.append(record)
            if len(chunk) >= self.spec.chunk_size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    async def generate(self, requests: Sequence[Request | BaseException],
                       attempts: Sequence[int] | None = None) -> list[Completion | BaseException]:
        """Run requests through the worker's engine host; an exception in stays an exception out.

        A constrained request (``response_format``) on an engine that cannot constrain
        fails here with that reason: it is never run unconstrained; one cut short by
        ``max_tokens`` (not schema-valid) fails as ``truncated_output``, and one whose
        text is not strict JSON or not valid against its schema as ``schema_invalid``
        (both retryable): a result that claims a format satisfies it.
        ``EngineDeadError`` is raised, never returned: a dead engine is the worker's
        fault, not the records', so the task fails and is retried on another worker.
        Cancelled (the task was abandoned), every request still in the engine is cancelled.

        With a ``dedup_scope``, identical deterministic requests (``pool.dedup``; ``attempts``
        gives each request's attempt number, part of what makes two identical) run once on
        this worker: the others get the leader's completion, or run on their own when it
        failed.
        """
        out: list[Completion | BaseException] = list(requests)  # type: ignore[arg-type]
        constrained_ok = supports_structured_output(self.host.engine)
        live: list[int] = []
        for i, r in enumerate(requests):
            if isinstance(r, Request):
                if r.params.response_format is not None and not constrained_ok:
                    out[i] = Completion.failed(unconstrained_error(getattr(self.host.engine, "name", "?")))
                else:
                    live.append(i)
        if self.spec.order == "prefix":  # requests that share a prefix side by side, one run into the engine
            live.sort(key=lambda i: prompt_order_key(requests[i].prompt))  # type: ignore[union-attr]
        scope = self.spec.dedup_scope
        memo = self.host.memo if scope is not None else None
        ignores_seed = greedy_ignores_seed(self.host.engine)
        leaders: list[int] = []  # go to the engine
        keys: dict[int, bytes] = {}  # leaders under a memo key
        waits: dict[int, asyncio.Future[Completion]] = {}  # every live request's future
        duplicates: set[int] = set()
        for i in live:
            r = requests[i]
            assert isinstance(r, Request)
            key = None if memo is None or scope is None else request_key(
                scope, r.prompt, r.params, attempts[i] if attempts is not None else 0, greedy_ignores_seed=ignores_seed)
            hit = None if key is None or memo is None else memo.answer(key)
            if hit is None:
                leaders.append(i)
                if key is not None and memo is not None:
                    keys[i] = key
                    waits[i] = memo.lead(key)
            elif isinstance(hit, Completion):
                out[i] = self._duplicate(r, hit)
            else:
                duplicates.add(i)
                waits[i] = hit
        try:
            gen, engine_futures = await self._submit([requests[i] for i in leaders])  # type: ignore[misc]
        except BaseException:
            for i in leaders:
                if i in keys and memo is not None:
                    memo.abandon(keys[i])
            for i in duplicates:
                waits[i].cancel()
            raise
        for i, future in zip(leaders, engine_futures):
            if i in keys and memo is not None:
                memo.attach(keys[i], future)
            else:
                waits[i] = future
        order = [i for i in live if i in waits]
        try:
            done = await asyncio.gather(*(waits[i] for i in order), return_exceptions=True)
        except asyncio.CancelledError:
            for i in order:
                waits[i].cancel()
            raise
        by_leader = dict(zip(leaders, gen))
        orphans: list[int] = []
        for i, result in zip(order, done):
            if isinstance(result, EngineDeadError):
                raise result
            if isinstance(result, Orphaned):  # the request it waited on (or its own) went away
                orphans.append(i)
                continue
            if i in duplicates:
                if isinstance(result, Completion):
                    out[i] = self._duplicate(requests[i], result)  # type: ignore[arg-type]
                else:  # its leader failed or went away: it runs on its own
                    orphans.append(i)
                continue
            if isinstance(result, Completion) and (request := by_leader[i]) is not None:
                self.meter.add(request, result)
                result = self._checked(request.params, result)
            out[i] = result
        if orphans:
            again = await self._run_plain([requests[i] for i in orphans])  # type: ignore[misc]
            for i, result in zip(orphans, again):
                out[i] = result
        return out

    def _checked(self, params: SamplingParams, completion: Completion) -> Completion:
        """``_checked``, counting the completions that failed their format (``schema_invalid``)."""
        result = _checked(params, completion)
        if result is not completion and ErrorKind.of(result.error) is ErrorKind.SCHEMA_INVALID:
            self.schema_invalid += 1
        return result

    def _duplicate(self, request: Request, completion: Completion) -> Completion:
        """An identical request's completion, as this request's own (its engine time: none)."""
        self.meter.add_duplicate(completion)
        return self._checked(request.params, completion)

    async def _submit(self, requests: Sequence[Request]) -> tuple[list[GenRequest | None], list[asyncio.Future[Completion]]]:
        """One future per request. The one tokenisation of each prompt: its ids cost it for the
        batcher and go on to the engine; a prompt the tokenizer (or chat template) rejects has
        no GenRequest and its failed Completion, resolved at once."""
        encoded = await self.host.encode([r.prompt for r in requests])
        if (block_size := prefix_block_size(self.host.engine)) is not None:
            await asyncio.to_thread(self.meter.sign, encoded, self.host.engine.prefix_signature, block_size)  # type: ignore[union-attr]
        gen: list[GenRequest | None] = [None if isinstance(tokens, Completion) else GenRequest(tokens, r.params, len(tokens.ids))
                                        for r, tokens in zip(requests, encoded)]
        submitted = iter(await self.host.submit([g for g in gen if g is not None], together=self.spec.order == "prefix"))
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Completion]] = []
        for g, tokens in zip(gen, encoded):
            if g is None:
                failed: asyncio.Future[Completion] = loop.create_future()
                failed.set_result(tokens)  # type: ignore[arg-type]
                futures.append(failed)
            else:
                futures.append(next(submitted))
        return gen, futures

    async def _run_plain(self, requests: Sequence[Request]) -> list[Completion | BaseException]:
        """Each request on its own (no memo): what a duplicate does when its leader failed."""
        gen, futures = await self._submit(requests)
        try:
            done = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            for f in futures:
                f.cancel()
            raise
        out: list[Completion | BaseException] = []
        for request, result in zip(gen, done):
            if isinstance(result, EngineDeadError):
                raise result
            if isinstance(result, Completion) and request is not None:
                self.meter.add(request, result)
                result = self._checked(request.params, result)
            out.append(result)
        return out


def _checked(params: SamplingParams, completion: Completion) -> Completion:
    """A constrained completion as a result only when it satisfies its format: cut by
    max_tokens it is ``truncated_output``, not strict JSON or not valid against its schema
    ``schema_invalid`` (both retryable)."""
    fmt = params.response_format
    if fmt is None or completion.error is not None:
        return completion
    if completion.finish_reason == "length":
        return Completion.failed(ErrorKind.TRUNCATED_OUTPUT.tag(
            f"max_tokens {params.max_tokens} reached before the constrained output was complete"),
            prompt_tokens=completion.prompt_tokens)
    if (why := format_error(completion.text, fmt)) is not None:
        return Completion.failed(ErrorKind.SCHEMA_INVALID.tag(why), prompt_tokens=completion.prompt_tokens)
    return completion


_clean = rows.strip_results  # a record re-inferred in a later round carries no earlier result


def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RequestError) else rows.error_text(exc)


def _prior_attempts(record: dict[str, Any]) -> int:
    value = record.get("attempts", 0)
    return value if isinstance(value, int) and value >= 0 else 0


def _request(builder: RequestBuilder, record: dict[str, Any], attempt: int) -> Request | BaseException:
    """The record's request for this attempt, or the reason it has none (its error)."""
    try:
        return builder.build(record, attempt)
    except (KeyError, RequestError) as exc:  # MissingFieldError / RequestError name the record
        return exc


# --------------------------------------------------------------------------- infer


async def run_infer(ctx: TaskContext) -> dict[str, int]:
    """One output row per input record: ``result`` or ``error``, usage, attempts + 1."""
    spec = ctx.spec
    assert spec.infer is not None
    builder = RequestBuilder(spec.infer)
    counts = {"ok": 0, "error": 0}
    async with ctx.file(spec.outputs["output"]).writer() as out:
        async for chunk in ctx.chunks():
            prior = [_prior_attempts(r) for r in chunk]
            results = await ctx.generate([_request(builder, r, n) for r, n in zip(chunk, prior)], prior)
            rows = []
            for record, n, res in zip(chunk, prior, results):
                row = {**_clean(record), "attempts": n + 1}
                if isinstance(res, Completion) and res.error is None:
                    row.update(result=res.text, error=None, finish_reason=res.finish_reason,
                               usage={"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens})
                    counts["ok"] += 1
                else:
                    error = res.error if isinstance(res, Completion) else _error_text(res)
                    usage = {"prompt_tokens": res.prompt_tokens if isinstance(res, Completion) else 0, "completion_tokens": 0}
                    row.update(result=None, error=error, finish_reason="error", usage=usage)
                    counts["error"] += 1
                rows.append(row)
            await out.write_many(rows)
    return counts


# --------------------------------------------------------------------------- judge


class Judging:
    """One task's judge: LLM judges go through the engine host (batcher or stream), rule judges run off-loop."""

    def __init__(self, ctx: TaskContext, config: JudgeConfig) -> None:
        self.ctx = ctx
        self.judge = build_judge(config) if config.kind != "human" else None
        self.escalate = config.escalate

    async def verdicts(self, records: Sequence[dict[str, Any]], results: Sequence[str],
                       attempts: Sequence[int] | None = None) -> list[Verdict]:
        """One verdict per record; ``attempts``: the attempt each result came from (pool.dedup)."""
        if self.judge is None:  # a human judge: every record waits for a person
            return [Verdict(False, HUMAN_REVIEW) for _ in records]
        if isinstance(self.judge, LLMJudge):
            judge = self.judge
            requests: list[Request | BaseException] = []
            for record, result in zip(records, results):
                try:
                    requests.append(Request(judge.prompt(record, result), judge.sampling))
                except KeyError as exc:
                    requests.append(exc)
            done = await self.ctx.generate(requests, attempts)
            return [judge.verdict(c) if isinstance(c, Completion) else Verdict(False, _judge_error(c)) for c in done]
        return await asyncio.to_thread(self._rules, list(records), list(results))

    def escalated(self, verdict: Verdict) -> bool:
        """Whether people decide this record (a human judge: always)."""
        return self.judge is None or (self.escalate is not None and self.escalate.matches(verdict))

    def _rules(self, records: list[dict[str, Any]], results: list[str]) -> list[Verdict]:
        assert self.judge is not None and not isinstance(self.judge, LLMJudge)
        out = []
        for record, result in zip(records, results):
            try:
                out.append(self.judge.judge(record, result))
            except Exception as exc:  # a rule that crashes on one record rejects that record only
                out.append(Verdict(False, _judge_error(exc)))
        return out


# Where a row sat in its wave: the judge pool's approved / rejected split is read back by it
# (ids may repeat in an input; positions do not).
_WAVE_POS = "_judge_wave_pos"


class PoolJudging:
    """A retry task's judge on the worker's judge pool (the judge's own model).

    Each wave is one judge task there, by reference: the wave's rows go to a shard under
    the task's ``judge_pool`` folder, the judge pool splits them into approved / rejected
    as a round's judge does, and the verdicts are read back by position. The judge task's
    id carries a digest of the wave (ids and results), so a replay of this task gets the
    same verdicts and no other wave ever reuses them. Escalation is applied here, as on
    the worker's own engine: nobody reviews in place.
    """

    def __init__(self, ctx: TaskContext, config: JudgeConfig) -> None:
        if ctx.judge_runner is None:
            raise TaskInputError(f"task {ctx.spec.task_id} judges on a judge pool, but this worker has none "
                                 "(start it with --judge-endpoint, or run the judge on this engine)")
        self.ctx = ctx
        self.runner = ctx.judge_runner
        self.config = config.model_copy(update={"escalate": None})
        self.escalate = config.escalate
        self.base = ctx.spec.outputs[JUDGE_POOL_OUTPUT]

    def escalated(self, verdict: Verdict) -> bool:
        return self.escalate is not None and self.escalate.matches(verdict)

    async def verdicts(self, records: Sequence[dict[str, Any]], results: Sequence[str],
                       attempts: Sequence[int] | None = None) -> list[Verdict]:
        """One verdict per record; ``attempts`` go with the rows, so the judge pool's memo keys by them."""
        ctx = self.ctx
        rows = [{**_clean(r), "result": res, "error": None, _WAVE_POS: i} for i, (r, res) in enumerate(zip(records, results))]
        if attempts is not None:
            for row, attempt in zip(rows, attempts):
                row["attempts"] = attempt
        digest = hashlib.blake2b(repr([(r["id"], r["result"]) for r in rows]).encode(), digest_size=8).hexdigest()
        folder = urls.join(self.base, digest)
        task = TaskSpec(
            task_id=f"{ctx.spec.task_id}/judge/{digest}", kind="judge", input_url=urls.join(folder, "input.jsonl.zst"),
            outputs={"approved": urls.join(folder, "approved.jsonl.zst"), "rejected": urls.join(folder, "rejected.jsonl.zst")},
            judge=self.config, chunk_size=ctx.spec.chunk_size, round=ctx.spec.round,
            storage_options_ref=ctx.spec.storage_options_ref, dedup_scope=ctx.spec.dedup_scope,
        )
        async with ctx.file(task.input_url).writer() as w:
            await w.write_many(rows)
        try:
            result = await self.runner.run_task(task)
        except TaskFailed as exc:
            raise JudgePoolError(f"task {ctx.spec.task_id}: the judge pool failed a wave of {len(rows)}: {exc}") from exc
        verdicts: list[Verdict | None] = [None] * len(rows)
        for key in ("approved", "rejected"):
            async for row in ctx.file(task.outputs[key]).iter_records():
                v = row.get("verdict")
                verdicts[int(row[_WAVE_POS])] = Verdict(**v) if v else Verdict(False, row.get("rejection") or "no_verdict")
        if any(v is None for v in verdicts):
            raise JudgePoolError(f"task {ctx.spec.task_id}: the judge pool returned {sum(v is not None for v in verdicts)} "
                                 f"of {len(rows)} verdicts for {folder}")
        ctx.meter.tokens_in += result.tokens_in
        ctx.meter.tokens_out += result.tokens_out
        await asyncio.to_thread(self._remove, folder)
        return verdicts  # type: ignore[return-value]

    def _remove(self, folder: str) -> None:
        try:
            fs, path = urls.fs_for(folder, self.ctx.storage_options)
            fs.rm(path, recursive=True)
        except (OSError, ValueError) as exc:  # scratch only: the verdicts are read
            log.warning("could not remove the judge wave folder %s: %s", folder, exc)


def _judge_error(exc: BaseException) -> str:
    text = str(exc)
    if ErrorKind.of(text) is ErrorKind.MISSING_FIELD:
        return text
    return ErrorKind.JUDGE_ERROR.tag(f"{type(exc).__name__}: {text}")


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
            verdicts = await judging.verdicts(ok, [r["result"] for r in ok], [_prior_attempts(r) for r in ok])
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


async def run_retry(ctx: TaskContext) -> dict[str, int]:
    """In-place retry: each record is re-inferred and re-judged until approved or max_attempts.

    A chunk advances in waves: every sample that needs inference is submitted in one
    ``generate`` call (one tokenizer pass, one ``submit_many``), then every sample with
    a result is judged in one call, so the per-sample cost equals a round's. A record's
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
        sample = _Sample(record, rid, _clean(record), _prior_attempts(record),
                         int(state.get("attempt", 0)), state.get("last_result"))
        if state.get("final"):
            sample.row = {**sample.base, **state["final"]}
        return sample

    async def infer_wave(wave: list[_Sample], ckpt: CheckpointBuffer) -> None:
        prompts = [_request(builder, s.record, s.prior + s.attempt) for s in wave]
        try:
            done = await ctx.generate(prompts, [s.prior + s.attempt for s in wave])
        except EngineDeadError:
            raise  # the worker's fault: the task is retried elsewhere and resumes from its checkpoints
        except Exception as exc:  # e.g. the tokenizer failed for the wave: each sample's own error
            for s in wave:
                s.error(_error_text(exc))
            return
        for s, prompt, res in zip(wave, prompts, done):
            if isinstance(prompt, BaseException):
                s.error(_error_text(prompt))
            elif isinstance(res, BaseException) or (res.error is not None and permanent_error({"error": res.error}) is None):
                # The engine raised for the whole batch, or this record's error is retryable
                # (engine_error, truncated_output; rows.permanent_error, the rule recompaction
                # applies between rounds): it costs this attempt (bounded by max_attempts),
                # never the record.
                s.last_error = _error_text(res) if isinstance(res, BaseException) else res.error
                s.attempt += 1
                ckpt.add({"id": s.rid, "attempt": s.attempt, "last_result": None})
            elif res.error is not None:  # permanent: every attempt would fail the same way
                s.row = {**s.base, "result": None, "status": Status.ERROR, "error": res.error, "attempts": s.prior + s.attempt + 1}
            else:
                s.result, s.last_error = res.text, None
                ckpt.add({"id": s.rid, "attempt": s.attempt, "last_result": s.result})

    async def judge_wave(wave: list[_Sample], ckpt: CheckpointBuffer) -> None:
        try:
            verdicts = await judging.verdicts([s.record for s in wave], [s.result for s in wave],  # type: ignore[misc]
                                              [s.prior + s.attempt for s in wave])
        except (EngineDeadError, JudgePoolError):
            raise  # the infrastructure's fault: the task is retried and resumes from its checkpoints
        except Exception as exc:
            for s in wave:
                s.error(_error_text(exc))
            return
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

    async def process(chunk: list[dict[str, Any]], ckpt: CheckpointBuffer) -> list[dict[str, Any]]:
        samples = [start(r) for r in chunk]
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
                await judge_wave(to_judge, ckpt)

    ckpt = CheckpointBuffer(store, ctx.checkpoint_interval_s)
    try:
        async with ctx.file(spec.outputs["output"]).writer() as out, ckpt:
            async for chunk in ctx.chunks():
                rows = await process(chunk, ckpt)
                await ckpt.flush()
                for row in rows:
                    counts[row["status"]] += 1
                await out.write_many(rows)
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
