"""The engine protocols: what every engine takes and returns.

Two shapes, one result type:

- ``Engine``: blocking and batch-oriented (transformers' ``generate``, the linear
  simulated model). Callers run ``generate`` off the event loop; the worker keeps it
  busy with a ``TokenBatcher``.
- ``StreamingEngine``: continuous batching (vLLM's own scheduler). Requests flow in one
  at a time as they arrive and each completion resolves on its own, so no batch waits
  for its longest decode. The worker keeps it full by admission control (at most
  ``capacity()`` requests in flight; producers beyond that suspend, which is the
  backpressure that reaches ``dispatch_bounded``).

In both, one bad item never fails its neighbours: it comes back as a ``Completion``
with ``finish_reason="error"`` and ``error`` set. A dead engine is not an item's fault:
it raises ``EngineDeadError`` and the worker reports itself unhealthy.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol, runtime_checkable

from batch_inference.rows import ErrorKind

FinishReason = Literal["stop", "length", "error"]


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages (OpenAI roles) that the engine renders with its model's own chat template.

    Rendering happens in the engine, where the tokenizer is (``engines.chat.encode_prompt``:
    ``apply_chat_template(..., add_generation_prompt=True)``), so the tokens the model sees
    are exactly the template's. Frozen and hashable, like ``SamplingParams``.
    """

    messages: tuple[tuple[str, str], ...]  # (role, content), already validated

    def as_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


# What a request's prompt is: raw text (tokenised as is, special tokens added) or chat.
Prompt = str | ChatPrompt


@dataclass(frozen=True, slots=True)
class Tokens:
    """A prompt encoded by the engine that runs it (its ``encode``): the engine takes ``ids`` as they are.

    The shard task encodes each request once, off the event loop, and hands these to the
    engine, so no prompt is tokenised twice (once to cost it for the batcher, again to run
    it). ``source`` is the prompt the ids encode: the simulated engines, which have no
    vocabulary (their ids are positions), answer from its text.
    """

    ids: Sequence[int]
    source: Prompt


@dataclass(frozen=True)
class ResponseFormat:
    """Constrained decoding: any JSON object, or JSON matching ``schema`` (canonical JSON text).

    Only engines with ``structured_output = True`` (vLLM's structured outputs) may run a
    request that carries one; the pool fails such a request on any other engine rather
    than run it unconstrained (``supports_structured_output``).
    """

    kind: Literal["json_object", "json_schema"]
    schema: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; frozen and hashable so engines can group by them."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    min_tokens: int = 0
    response_format: ResponseFormat | None = None
    adapter: str | None = None  # a LoRA adapter the engine serves (EngineConfig.lora); None: the base model
    # OpenAI's penalties on tokens already generated (vLLM's own); engines that cannot apply
    # them fail the item alone (``penalties_error``) rather than answer unpenalised
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # An embedding request (``infer.task: embed``): the engine pools the prompt's hidden states
    # into one vector and decodes nothing (sampling fields are unused; ``max_tokens`` costs nothing).
    # ``dimensions``: keep the vector's first N (Matryoshka), only where the model allows it.
    embed: bool = False
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.stop is not None and not isinstance(self.stop, tuple):
            # accept a list or a single string from config, keep the dataclass hashable
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            object.__setattr__(self, "stop", stop)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.dimensions is not None and (not self.embed or self.dimensions < 1):
            raise ValueError(f"dimensions must be >= 1 and is for embedding requests only, got {self.dimensions}")


@dataclass(frozen=True)
class Completion:
    """One prompt's result. ``error`` is set (and ``finish_reason == "error"``) when it failed."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    error: str | None = None
    # prompt tokens the engine's prefix cache supplied (vLLM's num_cached_tokens); None: the
    # engine keeps no prefix cache or does not say
    cached_tokens: int | None = None
    # answered from the cross-run result cache (pool.result_cache): no engine computed it
    from_cache: bool = False
    # the request's stop string that ended the text (finish_reason "stop"); None: EOS, the
    # length limit, or no stop string matched. Anthropic's ``stop_sequence`` is this one.
    stop_sequence: str | None = None
    # an embedding request's vector (``SamplingParams.embed``); ``text`` is then empty
    embedding: tuple[float, ...] | None = None

    @classmethod
    def failed(cls, error: str, prompt_tokens: int = 0) -> Completion:
        """A failed item; ``error`` is tagged with its ``ErrorKind`` (ValueError otherwise)."""
        return cls(text="", prompt_tokens=prompt_tokens, completion_tokens=0, finish_reason="error", error=ErrorKind.checked(error))


@dataclass(frozen=True)
class PrefixCacheStats:
    """An engine's prefix cache over its lifetime, in prompt tokens (vLLM: its scheduler's
    ``prefix_cache_stats``, summed): what was looked up, what was found cached, and the
    re-lookups of requests preempted and recomputed."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def computed(self) -> int:
        """Prompt tokens the engine prefilled: the misses, recomputation after preemption included."""
        return self.queries - self.hits + self.preempted_queries - self.preempted_hits

    def as_dict(self) -> dict[str, float | int]:
        return {"requests": self.requests, "queries": self.queries, "hits": self.hits,
                "preempted_queries": self.preempted_queries, "preempted_hits": self.preempted_hits,
                "hit_rate": round(self.hit_rate, 4), "computed": self.computed}


def prefix_block_size(engine: object) -> int | None:
    """The block size of the engine's prefix cache (attribute ``prefix_block_size``; absent or
    None: it keeps none). Such an engine also signs a request's Tokens (``prefix_signature``)."""
    size = getattr(engine, "prefix_block_size", None)
    return size if isinstance(size, int) and size > 0 else None


def prefix_cache_stats(engine: object) -> PrefixCacheStats | None:
    """The engine's own prefix-cache counters (method ``prefix_cache``; absent or None: it keeps none)."""
    method = getattr(engine, "prefix_cache", None)
    return method() if callable(method) else None


@runtime_checkable
class Engine(Protocol):
    """What workers, batchers and judges call. Blocking; same order as the input."""

    name: str
    max_model_len: int
    simulated: bool

    def encode(self, prompts: Sequence[Prompt]) -> list[Tokens | Completion]:
        """Each prompt's ``Tokens``, or the failed Completion of one it cannot encode (it fails alone)."""
        ...

    def generate(self, prompts: Sequence[Prompt | Tokens], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]: ...

    def close(self) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine itself is gone (its core process died, CUDA failed): no request can run.

    Never turned into per-record errors; the worker goes unhealthy so its tasks are
    retried on another worker and the launcher replaces it.
    """


@dataclass(frozen=True)
class EngineOccupancy:
    """The engine's own view of how full it is (``None`` where the engine cannot say).

    This, with output tokens/s, answers "is the GPU full?"; the batcher's busy/wall
    and fill only say whether the engine was being *called*.
    """

    running: int = 0  # sequences the engine is decoding now
    waiting: int = 0  # admitted requests the engine's scheduler has not started
    max_num_seqs: int | None = None  # the engine's own cap on concurrent sequences
    kv_cache_usage: float | None = None  # 0..1 of the KV cache in use


@runtime_checkable
class StreamingEngine(Protocol):
    """A continuous-batching engine, driven from the worker's event loop.

    ``complete`` is one request: it returns when that request finishes, whatever else is
    in flight, never raises for the request's own fault (overlong, empty, bad params
    come back as ``Completion.failed``), raises ``EngineDeadError`` when the engine is
    gone, and when cancelled aborts the request inside the engine (nothing keeps
    decoding for a caller that left). Per-request seeds give the same text whatever else
    is in flight.
    """

    name: str
    max_model_len: int
    simulated: bool

    def encode(self, prompts: Sequence[Prompt]) -> list[Tokens | Completion]: ...

    async def start(self) -> None:
        """Bind to the running event loop (called once, on the worker's loop)."""
        ...

    async def complete(self, prompt: Prompt | Tokens, params: SamplingParams) -> Completion: ...

    def capacity(self) -> int:
        """How many requests to keep in flight so the engine's scheduler is never starved."""
        ...

    def occupancy(self) -> EngineOccupancy: ...

    async def aclose(self) -> None: ...


def is_streaming(engine: object) -> bool:
    """True for engines the worker should stream into rather than batch for."""
    return isinstance(engine, StreamingEngine)


def supports_structured_output(engine: object) -> bool:
    """True for engines that constrain decoding to a ``ResponseFormat`` (class attribute
    ``structured_output``; absent means no). Not a protocol member, so engines that
    cannot constrain need not say so."""
    return bool(getattr(engine, "structured_output", False))


def greedy_ignores_seed(engine: object) -> bool:
    """True for engines whose greedy (temperature 0) output depends on the prompt alone
    (class attribute ``greedy_ignores_seed``; absent means no: the seed stays part of what
    makes two requests identical, ``pool.dedup``)."""
    return bool(getattr(engine, "greedy_ignores_seed", False))


def unconstrained_error(engine_name: str) -> str:
    """The per-item error for a constrained request on an engine that cannot constrain."""
    return ErrorKind.UNSUPPORTED_RESPONSE_FORMAT.tag(f"engine {engine_name} cannot constrain generation "
                                                    "(vLLM's structured outputs can); the request was not run unconstrained")


def token_counts(encoded: Sequence[Tokens | Completion]) -> list[int]:
    """Prompt token counts from ``encode`` (0 for a prompt it could not encode)."""
    return [len(e.ids) if isinstance(e, Tokens) else 0 for e in encoded]


def expand_params(prompts: Sequence[Prompt | Tokens], params: SamplingParams | Sequence[SamplingParams]) -> list[SamplingParams]:
    """One SamplingParams per prompt (a single one is shared)."""
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    return params


def group_by_params(params: Sequence[SamplingParams], *, ignore_seed: bool = False) -> dict[SamplingParams, list[int]]:
    """Indices of the prompts sharing each distinct SamplingParams, in first-seen order.

    With ``ignore_seed`` the keys have ``seed=None``: per-record seeds (which the pool
    always sends) must not split a batch into singletons on engines that seed per batch.
    """
    groups: dict[SamplingParams, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        groups[replace(p, seed=None) if ignore_seed else p].append(i)
    return dict(groups)


def combine_seeds(seeds: Sequence[int | None]) -> int | None:
    """One deterministic seed for a batch of per-item seeds (None when none is set)."""
    if all(s is None for s in seeds):
        return None
    digest = hashlib.blake2b(repr(list(seeds)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # torch.manual_seed takes < 2**63


def truncate_at_stop(text: str, stop: Sequence[str] | None) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string; returns (text, stopped)."""
    text, matched = cut_at_stop(text, stop)
    return text, matched is not None


def cut_at_stop(text: str, stop: Sequence[str] | None) -> tuple[str, str | None]:
    """Cut ``text`` before the earliest stop string; returns (text, the stop string that
    matched there, the first listed on a tie), so a caller can say which one ended it."""
    if not stop:
        return text, None
    found = min(((i, k) for k, s in enumerate(stop) if s and (i := text.find(s)) >= 0), default=None)
    if found is None:
        return text, None
    return text[: found[0]], stop[found[1]]


def penalties_error(p: SamplingParams, engine: str) -> str | None:
    """The per-item ``bad_sampling`` error of a request with presence/frequency penalties on an
    engine that cannot apply them (answering it unpenalised would ignore what it asked)."""
    asked = [f"{name} {getattr(p, name):g}" for name in ("presence_penalty", "frequency_penalty") if getattr(p, name)]
    if not asked:
        return None
    return ErrorKind.BAD_SAMPLING.tag(f"{' and '.join(asked)}: the {engine} engine cannot apply penalties (the vLLM engine does)")


def adapter_error(adapter: str | None, served: Sequence[str]) -> str | None:
    """The per-item ``bad_request`` error of a request naming an adapter the engine does not serve."""
    if adapter is None or adapter in served:
        return None
    offer = f"it serves {', '.join(sorted(served))}" if served else "it serves none (no lora options on this engine)"
    return ErrorKind.BAD_REQUEST.tag(f"LoRA adapter {adapter!r} is not loaded on this engine: {offer}")


def too_long_error(prompt_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    """The per-item ``prompt_too_long`` error, or None when the request fits."""
    if prompt_tokens + max_tokens > max_model_len:
        return ErrorKind.PROMPT_TOO_LONG.tag(f"{prompt_tokens} prompt tokens + {max_tokens} max_tokens > max_model_len {max_model_len}")
    return None
