"""What a shard task runs with: its spec, the worker's engine host, storage, and its meter.

``TaskContext`` is the one object every task kind (``pool.tasks``) and the judging
(``pool.judging``) take: it submits prompts to the worker's engine host (deduplicated
within a phase where the spec allows), opens the task's input and outputs by reference,
and meters records, tokens, cache figures and warnings into the task's result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
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
from batch_inference.engines.base import unconstrained_error
from batch_inference.engines.blocks import BLOCK_HASH_BYTES, DistinctBlocks
from batch_inference.engines.structured import format_error
from batch_inference.pool.dedup import Orphaned, identity_text, memo_key
from batch_inference.pool.engine_host import EngineHost
from batch_inference.pool.protocol import TaskRunner, TaskSpec
from batch_inference.pool.request import GenRequest
from batch_inference.pool.result_cache import ResultCache, store_key
from batch_inference.pool.slices import give_way
from batch_inference.prompting import Request, RequestBuilder, RequestError
from batch_inference.prompting.prefix import prompt_order_key
from batch_inference.rows import ErrorKind
from batch_inference.storage import JsonlFile

log = logging.getLogger(__name__)


class TaskInputError(ValueError):
    """The task's input is unusable as a whole (retrying cannot help): the worker answers 422."""


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
    # the cross-run result cache (pool.result_cache): deterministic requests looked up, and
    # those it answered (their tokens count as the task's; the engine computed none)
    cache_lookups: int = 0
    cache_hits: int = 0

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

    def add_cache_hit(self, completion: Completion) -> None:
        """A request answered from the result cache: its row carries its usage, no engine ran it."""
        self.tokens_in += completion.prompt_tokens
        self.tokens_out += completion.completion_tokens
        self.cache_hits += 1

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
    _cache: ResultCache | None = field(default=None, init=False, repr=False)
    _progress_failed: bool = field(default=False, init=False, repr=False)
    _cache_write: asyncio.Future[None] | None = field(default=None, init=False, repr=False)  # the last chunk's, chained

    @property
    def result_cache(self) -> ResultCache | None:
        """The spec's cross-run result cache (``pool.result_cache``), or None."""
        if self.spec.result_cache is None:
            return None
        if self._cache is None:
            self._cache = ResultCache(self.spec.result_cache, self.storage_options)
        return self._cache

    def file(self, url: str) -> JsonlFile:
        return JsonlFile(url, storage_options=self.storage_options)

    async def report_progress(self, records: int, counts: dict[str, int], *, committed: bool) -> None:
        """Replace the task's progress record (``spec.progress_url``) with how far it got:
        ``records`` of its input done, ``counts`` by outcome. ``committed``: they are on
        storage already (a retry task's checkpoints), so a cancelled task still delivers
        them; else they count only once the task ends. Written atomically, after each
        chunk; a failed write costs the figure, never the task (said once in its warnings)."""
        url = self.spec.progress_url
        if url is None:
            return
        record = {"task_id": self.spec.task_id, "records": records, "counts": dict(counts), "committed": committed,
                  "at": time.time()}
        try:
            async with self.file(url).writer() as w:
                await w.write(record)
        except Exception as exc:
            if not self._progress_failed:
                self._progress_failed = True
                self.warnings.append(f"progress record {url} not written ({rows.error_text(exc)}): progress shows per shard")

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
        cache = self.result_cache
        # what makes each request the same computation as another, made once for both keys
        identities: dict[int, str | None] = {}
        if memo is not None or cache is not None:
            for n, i in enumerate(live):
                await give_way(n)
                r = requests[i]
                assert isinstance(r, Request)
                identities[i] = identity_text(r.prompt, r.params, greedy_ignores_seed=ignores_seed)
        cache_keys: dict[int, str] = {}
        if cache is not None and live:
            live, cache_keys = await self._from_cache(cache, requests, attempts, live, out, identities)
        leaders: list[int] = []  # go to the engine
        keys: dict[int, bytes] = {}  # leaders under a memo key
        waits: dict[int, asyncio.Future[Completion]] = {}  # every live request's future
        duplicates: set[int] = set()
        try:  # a cancel at a slice boundary or in the submit abandons the leads made so far
            for n, i in enumerate(live):
                await give_way(n)
                r = requests[i]
                assert isinstance(r, Request)
                key = None if memo is None or scope is None or (text := identities[i]) is None else memo_key(
                    scope, attempts[i] if attempts is not None else 0, text)
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
        for n, (i, result) in enumerate(zip(order, done)):
            await give_way(n)
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
                result = self.checked_completion(request.params, result)
            out[i] = result
        if orphans:
            again = await self._run_plain([requests[i] for i in orphans])  # type: ignore[misc]
            for i, result in zip(orphans, again):
                out[i] = result
        if cache is not None and cache_keys:
            self._to_cache(cache, {key: c for i, key in cache_keys.items()
                                   if isinstance(c := out[i], Completion) and c.error is None and not c.from_cache})
        return out

    async def _from_cache(self, cache: ResultCache, requests: Sequence[Request | BaseException], attempts: Sequence[int] | None,
                          live: list[int], out: list[Completion | BaseException], identities: Mapping[int, str | None],
                          ) -> tuple[list[int], dict[int, str]]:
        """Answer what the result cache holds (one bulk lookup for the chunk): the requests left
        to compute, and the cache keys of those that may be stored once computed."""
        identity = await self.host.identity()
        if identity is None:  # a model with no content identity: computed, never looked up nor kept
            if not self.host.uncacheable_reported:
                self.host.uncacheable_reported = True
                self.warnings.append(f"result cache not used: {self.host.uncacheable}")
            return live, {}
        keys: dict[int, str] = {}
        for n, i in enumerate(live):
            await give_way(n)
            r = requests[i]
            assert isinstance(r, Request)
            if not r.explicit_seed:  # sampled under a seed nobody asked for: a fresh sample each run
                continue
            if (text := identities[i]) is not None:
                keys[i] = store_key(identity, attempts[i] if attempts is not None else 0, text)
        self.meter.cache_lookups += len(keys)
        if not keys:
            return live, keys
        try:
            found = await cache.get_many(list(keys.values()))
        except Exception as exc:  # the cache is a saving, never a reason to fail a task: compute them
            self.warnings.append(f"result cache lookup in {cache.url} failed ({rows.error_text(exc)}): computed instead")
            return live, {}
        hits = {i for i, key in keys.items() if key in found}
        for i in hits:
            completion = found[keys[i]]
            self.meter.add_cache_hit(completion)
            out[i] = self.checked_completion(requests[i].params, completion)  # type: ignore[union-attr]
        return [i for i in live if i not in hits], {i: k for i, k in keys.items() if i not in hits}

    def _to_cache(self, cache: ResultCache, entries: dict[str, Completion]) -> None:
        """Store the chunk's computed results (one bulk write) behind its back: the chunk's
        answers go on (its rows, the task's next chunk) while the write runs, one chunk's write
        at a time, in order; the task's result waits for them all (``settle_cache_writes``).
        A write in the chunk's path held every chunk of every task at its end for its whole
        write: thousands of small files, a thread fighting the event loop for the GIL."""
        if entries:
            self._cache_write = asyncio.ensure_future(self._put_cache(cache, entries, self._cache_write))

    async def _put_cache(self, cache: ResultCache, entries: dict[str, Completion], before: asyncio.Future[None] | None) -> None:
        """One chunk's write, after the one before it; a failed write costs reuse only."""
        if before is not None:
            await before
        try:
            await cache.put_many(entries)
        except Exception as exc:
            self.warnings.append(f"result cache write to {cache.url} failed ({rows.error_text(exc)}): {len(entries)} result(s) not kept")

    async def settle_cache_writes(self) -> None:
        """Wait for the task's result cache writes: a finished task's results are in the cache."""
        if self._cache_write is not None:
            await self._cache_write

    def drop_cache_writes(self) -> None:
        """A task that ends early (failed, cancelled) stops its writes not yet begun (a write's
        thread, once begun, finishes its entries: every one it writes is whole)."""
        if self._cache_write is not None and not self._cache_write.done():
            self._cache_write.cancel()

    def checked_completion(self, params: SamplingParams, completion: Completion) -> Completion:
        """``checked_completion``, counting the completions that failed their format (``schema_invalid``)."""
        result = checked_completion(params, completion)
        if result is not completion and ErrorKind.of(result.error) is ErrorKind.SCHEMA_INVALID:
            self.schema_invalid += 1
        return result

    def _duplicate(self, request: Request, completion: Completion) -> Completion:
        """An identical request's completion, as this request's own (its engine time: none)."""
        self.meter.add_duplicate(completion)
        return self.checked_completion(request.params, completion)

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
                result = self.checked_completion(request.params, result)
            out.append(result)
        return out


def checked_completion(params: SamplingParams, completion: Completion) -> Completion:
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




def error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RequestError) else rows.error_text(exc)


def prior_attempts(record: dict[str, Any]) -> int:
    value = record.get("attempts", 0)
    return value if isinstance(value, int) and value >= 0 else 0


def attempt_request(builder: RequestBuilder, record: dict[str, Any], attempt: int) -> Request | BaseException:
    """The record's request for this attempt, or the reason it has none (its error)."""
    try:
        return builder.build(record, attempt)
    except (KeyError, RequestError) as exc:  # MissingFieldError / RequestError name the record
        return exc


# --------------------------------------------------------------------------- infer
