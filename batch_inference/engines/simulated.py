"""Simulated engines for benchmarks and scale tests (never the default).

Three cost models behind one config (``SimulatedOptions``); all answer alike:

- ``LinearSimulatedEngine`` (``cost_model: linear``, the default): each
  ``generate`` call sleeps ``a + b x batch_tokens`` seconds in the calling thread (the
  worker calls it via ``asyncio.to_thread``), where batch_tokens is the sum of prompt +
  output tokens, or ``n x max(prompt + output)`` in padded mode. Every batch is as if
  perfectly packed: it knows nothing of decode steps.
- ``DecodeBatchEngine`` (``cost_model: decode, scheduling: blocking``): one blocking
  call per batch through the decode-step model (``decode_model.py``): the batch lasts as
  long as its longest decode, with fewer and fewer sequences per step towards its end.
  What a static ``LLM.generate`` per token-budgeted batch gets from vLLM.
- ``DecodeStreamingEngine`` (``cost_model: decode, scheduling: continuous``): the
  ``StreamingEngine`` protocol over the same model: requests join the running batch at
  the next step and each resolves when its own decode ends.

Outputs are deterministic pseudo-random words from hash(engine seed, request seed,
prompt) (at temperature 0 with ``greedy: prompt``, from the engine seed and prompt
alone), one word per output token; the first word is APPROVED with probability
``approval_rate`` (else REJECTED), so as an LLM judge it approves at that rate and
attempts with different seeds are independent. Output lengths are drawn per record from
the same hash (``output_lengths``: fixed / geometric / pareto, mean ``output_tokens``),
so a record's length never depends on what else is in flight. A request on a LoRA adapter
(``simulated.lora``) salts the hash with the adapter's name. Token counting is a cheap
documented rule: ``max(1, ceil(len(text) / 4))``, its ids the positions (``encode``); chat
prompts count (and hash) as their plain-text view (``engines.chat.prompt_text``).

With ``prefix_cache`` (decode model) the engines keep vLLM's automatic prefix cache
(``engines.prefix_cache.PrefixCache``): a prompt's leading blocks of ``profile.block_size`` tokens
(4 characters a token), keyed by chained hashes of their text, are not prefilled again
while they stay cached; completions carry ``cached_tokens`` and the engine its
``prefix_cache()`` counters, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

from batch_inference.engines.base import (
    Completion,
    EngineDeadError,
    EngineOccupancy,
    PrefixCacheStats,
    Prompt,
    SamplingParams,
    Tokens,
    adapter_error,
    expand_params,
    token_counts,
    too_long_error,
    cut_at_stop,
)
from batch_inference.engines.chat import prompt_text
from batch_inference.engines.config import EngineConfig, SimulatedOptions
from batch_inference.engines.blocks import block_keys, text_signature
from batch_inference.engines.decode_model import DecodeScheduler
from batch_inference.engines.lengths import draw_output_tokens, record_rng
from batch_inference.engines.prefix_cache import PrefixCache
from batch_inference.engines.profiles import DecodeProfile, get_profile
from batch_inference.rows import ErrorKind

log = logging.getLogger(__name__)

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


SIMULATED_CHARS_PER_TOKEN = 4


def simulated_token_count(text: str) -> int:
    """The simulated tokenizer: one token per 4 characters, at least one."""
    return max(1, math.ceil(len(text) / SIMULATED_CHARS_PER_TOKEN))


def simulated_text_tokens(words: float) -> float:
    """Mean tokens the simulated tokenizer counts in a simulated answer of ``words`` words
    (``simulated_completion``: its verdict word, then words of ``_WORDS``, single spaces):
    what a prompt quoting the answer carries (the planner's judge prompt)."""
    if words <= 0:
        return 0.0
    verdict = len("APPROVED")  # == len("REJECTED")
    chars = verdict + (words - 1) * (sum(map(len, _WORDS)) / len(_WORDS) + 1)
    return chars / SIMULATED_CHARS_PER_TOKEN


def simulated_encode(prompt: Prompt) -> Tokens:
    """The simulated tokenizer's ``Tokens``: positions as ids (it has no vocabulary)."""
    return Tokens(range(simulated_token_count(prompt_text(prompt))), prompt)


def simulated_completion(prompt: Prompt | Tokens, p: SamplingParams, options: SimulatedOptions, *, seed: int, max_model_len: int) -> Completion:
    """What every simulated engine answers for one prompt (its length drives the cost)."""
    tokens = prompt if isinstance(prompt, Tokens) else simulated_encode(prompt)
    prompt = prompt_text(tokens.source)
    n_prompt = len(tokens.ids)
    if options.fail_on is not None and options.fail_on in prompt:
        return Completion.failed(ErrorKind.SIMULATED_ERROR.tag(f"prompt contains {options.fail_on!r}"), prompt_tokens=n_prompt)
    if err := too_long_error(n_prompt, p.max_tokens, max_model_len):
        return Completion.failed(err, prompt_tokens=n_prompt)
    if err := adapter_error(p.adapter, tuple(options.lora.adapters) if options.lora else ()):
        return Completion.failed(err, prompt_tokens=n_prompt)
    greedy_by_prompt = p.temperature == 0 and options.greedy == "prompt"
    # an adapter answers unlike the base model and unlike another adapter
    salt = (p.adapter,) if p.adapter else ()
    rng = record_rng(seed, None if greedy_by_prompt else p.seed, prompt, *salt)
    verdict = "APPROVED" if rng.random() < options.approval_rate else "REJECTED"
    n_words = draw_output_tokens(
        rng, options.output_lengths, options.output_tokens,
        max_tokens=p.max_tokens, min_tokens=p.min_tokens, pareto_alpha=options.pareto_alpha,
    )
    text = " ".join([verdict, *(rng.choice(_WORDS) for _ in range(n_words - 1))])
    text, matched = cut_at_stop(text, p.stop)
    # one word = one output token; "length" when max_tokens capped the output
    reason = "stop" if matched is not None or n_words < p.max_tokens else "length"
    return Completion(text=text, prompt_tokens=n_prompt, completion_tokens=len(text.split()), finish_reason=reason,
                      stop_sequence=matched)


def decode_profile(options: SimulatedOptions, *, max_model_len: int | None = None) -> DecodeProfile:
    """The options' preset with its overrides applied."""
    profile = get_profile(options.profile)
    overrides = {k: v for k, v in options.decode.model_dump().items() if v is not None}
    profile = replace(profile, **overrides) if overrides else profile
    if max_model_len is not None and max_model_len > profile.kv_capacity_tokens:
        raise ValueError(f"max_model_len {max_model_len} exceeds the profile's KV cache ({profile.kv_capacity_tokens} tokens)")
    return profile


class SimulatedBatchError(RuntimeError):
    """Raised for a whole batch by ``fail_batch_every`` (fault injection)."""


class _Answers:
    """Shared by the simulated engines: config, tokenizer, completions, call counting."""

    simulated = True

    def __init__(self, options: SimulatedOptions | None, max_model_len: int, seed: int) -> None:
        self.options = options or SimulatedOptions()
        self.max_model_len = max_model_len
        self.seed = seed
        self.calls = 0
        self.busy_s = 0.0  # total modelled engine time, for reports
        self._lock = threading.Lock()

    @property
    def prefix_block_size(self) -> int | None:
        """The decode model's KV block size with its prefix cache on (``prefix_cache``), else None."""
        profile = getattr(self, "profile", None)
        return profile.block_size if self.options.prefix_cache and profile is not None else None

    def prefix_signature(self, tokens: Tokens) -> bytes:
        """The prompt's cacheable blocks, keyed by their text (its tokens are 4 characters each)."""
        return text_signature(prompt_text(tokens.source), len(tokens.ids), self.prefix_block_size or 1, SIMULATED_CHARS_PER_TOKEN)

    def _blocks(self, prompt: Prompt | Tokens) -> list[bytes]:
        """The prefix cache's keys of a prompt's cacheable blocks (none without the cache)."""
        if self.prefix_block_size is None:
            return []
        tokens = prompt if isinstance(prompt, Tokens) else simulated_encode(prompt)
        return block_keys(self.prefix_signature(tokens))

    def prefix_cache(self) -> PrefixCacheStats | None:
        cache: PrefixCache | None = getattr(self, "cache", None)
        if cache is None:
            return None
        return PrefixCacheStats(cache.requests, cache.queries, cache.hits, cache.preempted_queries, cache.preempted_hits)

    @property
    def greedy_ignores_seed(self) -> bool:
        """Only with ``greedy: prompt``: by default a simulated retry at temperature 0 draws anew."""
        return self.options.greedy == "prompt"

    def encode(self, prompts: Sequence[Prompt]) -> list[Tokens | Completion]:
        return [simulated_encode(p) for p in prompts]

    def count_tokens(self, prompts: list[Prompt]) -> list[int]:
        return token_counts(self.encode(prompts))

    def answer(self, prompt: Prompt | Tokens, p: SamplingParams) -> Completion:
        """One request's completion: every generate path of this engine computes through here,
        so wrapping it counts (or fails) the engine's computations (the dedup tests do)."""
        return simulated_completion(prompt, p, self.options, seed=self.seed, max_model_len=self.max_model_len)

    def _count_call(self) -> int:
        with self._lock:
            self.calls += 1
            call = self.calls
        if self.options.fail_batch_every and call % self.options.fail_batch_every == 0:
            raise SimulatedBatchError(f"simulated batch failure (call {call}, every {self.options.fail_batch_every})")
        return call

    def _sleep_rest(self, cost: float, started: float) -> None:
        """Sleep what is left of ``cost``: building the outputs is part of the modelled time."""
        with self._lock:
            self.busy_s += cost
        time.sleep(max(0.0, cost - (time.perf_counter() - started)))


class LinearSimulatedEngine(_Answers):
    """The linear model: sleeps ``a + b x batch_tokens`` per call, as if perfectly packed."""

    def __init__(self, options: SimulatedOptions | None = None, *, max_model_len: int = 4096, seed: int = 0) -> None:
        super().__init__(options, max_model_len, seed)
        o = self.options
        self.name = f"simulated-linear(a={o.latency_a_s}s, b={o.latency_b_s}s/token{', padded' if o.padded else ''})"

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> LinearSimulatedEngine:
        return cls(cfg.simulated, max_model_len=cfg.max_model_len or 4096, seed=cfg.seed)

    def cost_s(self, prompt_tokens: list[int], output_tokens: list[int]) -> float:
        """Seconds one batch takes under the cost model."""
        totals = [p + o for p, o in zip(prompt_tokens, output_tokens)]
        if not totals:
            return 0.0
        batch_tokens = len(totals) * max(totals) if self.options.padded else sum(totals)
        return self.options.latency_a_s + self.options.latency_b_s * batch_tokens

    def generate(self, prompts: Sequence[Prompt | Tokens], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        per_item = expand_params(prompts, params)
        self._count_call()
        started = time.perf_counter()
        out = [self.answer(prompt, p) for prompt, p in zip(prompts, per_item)]
        ran = [c for c in out if c.error is None]
        self._sleep_rest(self.cost_s([c.prompt_tokens for c in ran], [c.completion_tokens for c in ran]), started)
        return out

    def close(self) -> None:
        """Nothing to release."""



class DecodeBatchEngine(_Answers):
    """One blocking call per batch through the decode-step model: the batch is a barrier.

    Each ``generate`` runs a fresh scheduler over just its prompts (bounded by
    ``max_num_seqs`` and the KV cache, as vLLM's ``LLM.generate`` is) and sleeps the
    modelled time, which is set by the batch's longest decode.
    """

    def __init__(self, options: SimulatedOptions | None = None, *, max_model_len: int = 4096, seed: int = 0) -> None:
        super().__init__(options, max_model_len, seed)
        self.profile = decode_profile(self.options, max_model_len=max_model_len)
        self.name = f"simulated-decode-blocking({self.profile.name})"
        self.completed = 0
        self.output_tokens = 0
        # the engine's prefix cache outlives its calls, as vLLM's does across LLM.generate calls
        self.cache = PrefixCache(self.profile.block_size) if self.options.prefix_cache else None

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> DecodeBatchEngine:
        return cls(cfg.simulated, max_model_len=cfg.max_model_len or 4096, seed=cfg.seed)

    def batch_time_s(self, prompt_tokens: list[int], output_tokens: list[int],
                     blocks: Sequence[Sequence[bytes]] | None = None) -> float:
        """Modelled seconds of one blocking call over these requests."""
        return self._run_batch(prompt_tokens, output_tokens, blocks)[0]

    def _run_batch(self, prompt_tokens: list[int], output_tokens: list[int],
                   blocks: Sequence[Sequence[bytes]] | None) -> tuple[float, dict[object, int]]:
        """Modelled seconds of one call, and each request's prompt tokens taken from the cache."""
        sched = DecodeScheduler(self.profile, self.cache)
        for i, (p, o) in enumerate(zip(prompt_tokens, output_tokens)):
            sched.add(i, p, max(1, o), blocks[i] if blocks is not None else ())
        cached: dict[object, int] = {}
        start = sched.now_s
        while not sched.idle:
            cached.update(sched.step().cached)
        return sched.now_s - start, cached

    def generate(self, prompts: Sequence[Prompt | Tokens], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        per_item = expand_params(prompts, params)
        dead_after = self.options.die_after_requests
        if dead_after is not None and self.completed >= dead_after:
            raise EngineDeadError(f"simulated engine died after {dead_after} requests")
        self._count_call()
        started = time.perf_counter()
        out = [self.answer(prompt, p) for prompt, p in zip(prompts, per_item)]
        ran = [i for i, c in enumerate(out) if c.error is None]
        with self._lock:  # the cache is the engine's: one call at a time models it
            seconds, cached = self._run_batch([out[i].prompt_tokens for i in ran], [out[i].completion_tokens for i in ran],
                                              [self._blocks(prompts[i]) for i in ran] if self.cache is not None else None)
        if self.cache is not None:
            for j, i in enumerate(ran):
                out[i] = replace(out[i], cached_tokens=cached.get(j, 0))
        self._sleep_rest(seconds, started)
        with self._lock:
            self.completed += len(out)
            self.output_tokens += sum(out[i].completion_tokens for i in ran)
        return out

    def close(self) -> None:
        """Nothing to release."""


# A step that starts more than this late (a loaded machine, a blocked loop) starts when it
# can: modelled time is lost, never compressed to catch up.
_MAX_LAG_S = 0.002


class DecodeStreamingEngine(_Answers):
    """Continuous batching over the decode-step model (the ``StreamingEngine`` protocol).

    A step loop on the caller's event loop advances a ``DecodeScheduler`` and sleeps each
    step's modelled duration in real time, so a pipeline driving it measures itself
    against a GPU-like engine. ``complete`` is one request: it joins at the next step and
    returns when its own decode ends; cancelling it aborts the request in the scheduler
    (its sequence slot and KV are freed at once). ``die_after_requests`` kills the engine:
    every in-flight and later request raises ``EngineDeadError``, as it does when the step
    loop itself stops (an error in the model, a cancelled loop), naming why.
    """

    def __init__(self, options: SimulatedOptions | None = None, *, max_model_len: int = 4096, seed: int = 0) -> None:
        super().__init__(options, max_model_len, seed)
        self.profile = decode_profile(self.options, max_model_len=max_model_len)
        self.name = f"simulated-decode-continuous({self.profile.name})"
        self.cache = PrefixCache(self.profile.block_size) if self.options.prefix_cache else None
        self.scheduler = DecodeScheduler(self.profile, self.cache)
        self.completed = 0
        self.output_tokens = 0
        self._ids = itertools.count()
        self._futures: dict[int, asyncio.Future[int | None]] = {}  # resolved with its cached prompt tokens
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> DecodeStreamingEngine:
        return cls(cfg.simulated, max_model_len=cfg.max_model_len or 4096, seed=cfg.seed)

    async def start(self) -> None:
        if self._loop_task is not None:
            return
        self._wake = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._step_loop(), name="simulated-engine-steps")

    async def complete(self, prompt: Prompt | Tokens, params: SamplingParams) -> Completion:
        if self._dead is not None:
            raise self._dead
        if self._loop_task is None or self._wake is None:
            raise RuntimeError("DecodeStreamingEngine is not started (await engine.start() on the worker's loop)")
        completion = self.answer(prompt, params)
        if completion.error is not None:
            return completion
        rid = next(self._ids)
        future: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._futures[rid] = future
        self.scheduler.add(rid, completion.prompt_tokens, max(1, completion.completion_tokens), self._blocks(prompt))
        self._wake.set()
        try:
            cached = await future
        except asyncio.CancelledError:
            self.scheduler.abort(rid)  # nothing keeps decoding for a caller that left
            raise
        finally:
            self._futures.pop(rid, None)
        return completion if cached is None else replace(completion, cached_tokens=cached)

    def capacity(self) -> int:
        """Twice what the engine can run at once: finished sequences are replaced at the next step."""
        return 2 * self.profile.max_num_seqs

    def occupancy(self) -> EngineOccupancy:
        s = self.scheduler
        return EngineOccupancy(
            running=s.running,
            waiting=s.waiting,
            max_num_seqs=self.profile.max_num_seqs,
            kv_cache_usage=s.kv_used / self.profile.kv_capacity_tokens,
        )

    async def aclose(self) -> None:
        self._die(EngineDeadError("simulated engine closed"))
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def close(self) -> None:
        """Synchronous close for owners that cannot await (the loop task dies with its loop)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None

    async def _step_loop(self) -> None:
        """Steps the scheduler; once it stops, every waiting and later request fails saying why."""
        try:
            await self._steps()
        except asyncio.CancelledError:
            self._die(EngineDeadError("simulated engine's step loop was cancelled"))
            raise
        except Exception as exc:
            log.exception("simulated engine's step loop died")
            self._die(EngineDeadError(f"simulated engine's step loop died: {type(exc).__name__}: {exc}"))

    async def _steps(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        clock = loop.time()  # modelled end of the last step
        while True:
            if sched.idle:
                self._wake.clear()
                await self._wake.wait()
                clock = loop.time()
                continue
            if loop.time() - clock > _MAX_LAG_S:
                clock = loop.time()
            result = sched.step()
            clock += result.duration_s
            self.busy_s += result.duration_s
            if (delay := clock - loop.time()) > 0:
                await asyncio.sleep(delay)
            for rid in result.finished:
                future = self._futures.get(rid)
                if future is not None and not future.done():
                    future.set_result(result.cached.get(rid))
            self.completed += len(result.finished)
            self.output_tokens = sched.output_tokens
            dead_after = self.options.die_after_requests
            if dead_after is not None and self.completed >= dead_after:
                self._die(EngineDeadError(f"simulated engine died after {dead_after} requests"))
                return

    def _die(self, error: EngineDeadError) -> None:
        self._dead = self._dead or error
        for rid, future in list(self._futures.items()):
            self.scheduler.abort(rid)
            if not future.done():
                future.set_exception(self._dead)
