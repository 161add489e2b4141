"""Embedding engines (``engine.task: embed``): each prompt pooled into one vector, no decoding.

Both are blocking ``Engine`` s: the worker feeds them through its ``TokenBatcher``, whose
budget counts prompt tokens alone for an embedding request (``GenRequest.cost``). vLLM's
streaming path (``AsyncLLM``) is for decoding; an embedding forward has no decode tail for
continuous batching to hide, so ``engine.task: embed`` builds the blocking ``LLM.embed``
engine even where ``vllm.streaming`` is on (docs/engines.md "Embeddings").

- ``TransformersEmbedEngine``: ``AutoModel`` (a BERT-like encoder or a decoder's base
  model) on right-padded batches; mean, last-token or CLS pooling over the attention mask.
- ``VllmEmbedEngine``: ``LLM(runner="pooling")`` and ``LLM.embed`` on token ids, with the
  pooling and normalisation given to vLLM's ``PoolerConfig``.

A request's ``dimensions`` keeps a vector's first N (Matryoshka) only on a model whose config
says it may (``is_matryoshka`` / ``matryoshka_dimensions``, as vLLM reads them); elsewhere it
fails that request alone (``bad_request``). Vectors are truncated first, then normalised,
as vLLM and OpenAI do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from batch_inference.engines.base import Completion, Prompt, SamplingParams, Tokens, expand_params, token_counts
from batch_inference.engines.config import EmbeddingOptions, EngineConfig
from batch_inference.rows import ErrorKind

log = logging.getLogger(__name__)

Pooling = Literal["mean", "last", "cls"]
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


def model_pooling(model_dir: str | Path, *, decoder: bool) -> tuple[Pooling, bool]:
    """The model's own pooling and normalisation, from its sentence-transformers files
    (``modules.json`` naming a ``Pooling`` folder and a ``Normalize`` module), as vLLM reads
    them; without them last-token pooling for a decoder, CLS for an encoder, normalised."""
    root = Path(model_dir)
    pooling: Pooling = "last" if decoder else "cls"
    normalize = True
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return pooling, normalize
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith("Normalize") for t in types)
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
            try:
                cfg = json.loads((root / str(m.get("path", "")) / "config.json").read_text())
            except (OSError, ValueError):
                break
            pooling = next((mode for key, mode in _ST_POOLING.items() if cfg.get(key)), pooling)  # type: ignore[assignment]
    return pooling, normalize


def matryoshka(config: Any) -> tuple[bool, list[int] | None]:
    """Whether a model config allows ``dimensions`` and, if it lists them, which (vLLM's rule)."""
    dims = getattr(config, "matryoshka_dimensions", None)
    return bool(dims) or bool(getattr(config, "is_matryoshka", False)), list(dims) if dims else None


def dimensions_error(dimensions: int | None, size: int, allowed: tuple[bool, list[int] | None], model: str) -> str | None:
    """The per-item ``bad_request`` error of a ``dimensions`` the model cannot give, else None."""
    if dimensions is None:
        return None
    ok, listed = allowed
    if not ok:
        return ErrorKind.BAD_REQUEST.tag(f"dimensions {dimensions}: model {model} does not support Matryoshka embeddings "
                                         f"(its vectors have {size} dimensions; leave dimensions out)")
    if not 1 <= dimensions <= size or (listed is not None and dimensions not in listed):
        within = f"one of {listed}" if listed else f"in [1, {size}]"
        return ErrorKind.BAD_REQUEST.tag(f"dimensions {dimensions}: model {model} gives dimensions {within}")
    return None


def embed_request_error(p: SamplingParams, prompt_tokens: int, max_model_len: int) -> str | None:
    """The per-item error of a request an embedding engine cannot run (no vector from it)."""
    if not p.embed:
        return ErrorKind.BAD_REQUEST.tag("this engine embeds (engine.task: embed): it cannot generate text; "
                                         "use infer.task: embed, or a generating engine")
    if p.adapter is not None:
        return ErrorKind.BAD_REQUEST.tag(f"LoRA adapter {p.adapter!r}: an embedding engine serves none")
    if prompt_tokens == 0:
        return ErrorKind.EMPTY_PROMPT.tag("the prompt has no tokens")
    if prompt_tokens > max_model_len:
        return ErrorKind.PROMPT_TOO_LONG.tag(f"{prompt_tokens} prompt tokens > max_model_len {max_model_len}")
    return None


def embedding_completion(vector: Sequence[float], prompt_tokens: int) -> Completion:
    """One embedding result: the vector, its prompt's tokens, nothing generated."""
    return Completion(text="", prompt_tokens=prompt_tokens, completion_tokens=0, finish_reason="stop",
                      embedding=tuple(float(x) for x in vector))


class _EmbedShape(Protocol):
    max_model_len: int
    size: int
    matryoshka: Any
    name: str


def checked_requests(prompts: Sequence[Prompt | Tokens], per_item: Sequence[SamplingParams],
                     encode: Callable[[Prompt], Tokens | Completion], engine: _EmbedShape
                     ) -> tuple[list[Completion | None], dict[int, list[int]]]:
    """Each request encoded and checked (length, ``dimensions``) as both embedding engines do:
    the failed ones' completions in place (a request that cannot run fails alone), and the token
    ids of those that run, by index."""
    out: list[Completion | None] = [None] * len(prompts)
    ready: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        tokens = prompt if isinstance(prompt, Tokens) else encode(prompt)
        if isinstance(tokens, Completion):
            out[i] = tokens
        elif err := (embed_request_error(per_item[i], len(tokens.ids), engine.max_model_len)
                     or dimensions_error(per_item[i].dimensions, engine.size, engine.matryoshka, engine.name)):
            out[i] = Completion.failed(err, prompt_tokens=len(tokens.ids))
        else:
            ready[i] = list(tokens.ids)
    return out, ready


class TransformersEmbedEngine:
    """Blocking embeddings with ``AutoModel``: one padded forward per batch, pooled per row."""

    simulated = False
    greedy_ignores_seed = True  # a vector depends on the prompt alone

    def __init__(self, model: str, *, device: str = "auto", dtype: str = "auto", num_threads: int | None = 1,
                 max_model_len: int | None = None, options: EmbeddingOptions | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from batch_inference.engines.chat import TokenizerCopy

        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if self.device == "cpu" and num_threads:
            torch.set_num_threads(num_threads)  # as the generating engine: one thread per worker on small CPUs
        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        torch_dtype = dtypes.get(dtype) or (torch.bfloat16 if self.device == "cuda" else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.tokenizer.padding_side = "right"  # rows pool over their own mask; the last token is at len - 1
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.model_max_length = 1 << 40  # checked per item against max_model_len
        self.model = AutoModel.from_pretrained(model, dtype=torch_dtype).to(self.device).eval()
        config = self.model.config
        self.max_model_len = max_model_len or int(getattr(config, "max_position_embeddings", 512))
        own_pooling, own_normalize = model_pooling(model, decoder=getattr(config, "model_type", "") not in _ENCODERS)
        options = options or EmbeddingOptions()
        self.pooling: Pooling = options.pooling or own_pooling
        self.normalize = own_normalize if options.normalize is None else options.normalize
        self.size = int(config.hidden_size)
        self.matryoshka = matryoshka(config)
        self.name = f"transformers-embed:{model}"
        self._counting = TokenizerCopy(self.tokenizer)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> TransformersEmbedEngine:
        assert cfg.model is not None
        return cls(cfg.model, device=cfg.device, dtype=cfg.dtype, num_threads=cfg.num_threads, max_model_len=cfg.max_model_len,
                   options=cfg.embedding)

    def encode(self, prompts: Sequence[Prompt]) -> list[Tokens | Completion]:
        from batch_inference.engines.chat import encode_each

        with self._counting as tokenizer:
            return encode_each(tokenizer, prompts)

    def count_tokens(self, prompts: list[Prompt]) -> list[int]:
        return token_counts(self.encode(prompts))

    def generate(self, prompts: Sequence[Prompt | Tokens], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Each prompt's vector (``Completion.embedding``); a request it cannot run fails alone."""
        from batch_inference.engines.chat import encode_each

        per_item = expand_params(prompts, params)
        out, ready = checked_requests(prompts, per_item, lambda p: encode_each(self.tokenizer, [p])[0], self)
        if ready:
            items = list(ready)
            for i, vector in zip(items, self._run([ready[i] for i in items], [per_item[i].dimensions for i in items])):
                out[i] = vector if isinstance(vector, Completion) else embedding_completion(vector, len(ready[i]))
        return [c for c in out if c is not None]

    def _run(self, batch: list[list[int]], dims: list[int | None]) -> list[list[float] | Completion]:
        """One forward for the batch; if it raises, each row alone so one bad row fails alone."""
        try:
            return list(self._forward(batch, dims))
        except Exception as exc:
            if len(batch) == 1:
                log.warning("embedding failed for one item: %s", exc)
                return [Completion.failed(ErrorKind.ENGINE_ERROR.tag(f"{type(exc).__name__}: {exc}"), prompt_tokens=len(batch[0]))]
            log.warning("embedding failed for a batch of %d; retrying item by item: %s", len(batch), exc)
            return [self._run([ids], [d])[0] for ids, d in zip(batch, dims)]

    def _forward(self, batch: list[list[int]], dims: list[int | None]) -> list[list[float]]:
        import torch

        with torch.inference_mode():
            enc = self.tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt").to(self.device)
            hidden = self.model(**enc).last_hidden_state.float()
            vectors = pool(hidden, enc["attention_mask"], self.pooling)
            return [finish_vector(v, d, self.normalize) for v, d in zip(vectors, dims)]

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]


_ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "modernbert", "nomic_bert", "electra"})


def pool(hidden: Any, mask: Any, how: Pooling) -> Any:
    """Rows of ``hidden`` ([batch, seq, dim], right-padded) pooled over their ``mask``."""
    import torch

    if how == "cls":
        return hidden[:, 0]
    if how == "last":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


def finish_vector(vector: Any, dimensions: int | None, normalize: bool) -> list[float]:
    """Truncated to ``dimensions`` (Matryoshka) first, then L2-normalised, as vLLM does."""
    import torch

    v = vector[:dimensions] if dimensions is not None else vector
    if normalize:
        v = torch.nn.functional.normalize(v, p=2, dim=-1)
    return v.tolist()


class VllmEmbedEngine:
    """Blocking embeddings with vLLM's pooling runner: ``LLM.embed`` on token ids."""

    simulated = False
    greedy_ignores_seed = True

    def __init__(self, cfg: EngineConfig) -> None:
        from vllm import LLM
        from vllm.config import PoolerConfig

        assert cfg.model is not None
        o = cfg.vllm
        kwargs: dict[str, Any] = {"model": cfg.model, "runner": "pooling", "dtype": cfg.dtype, "seed": cfg.seed,
                                  "gpu_memory_utilization": o.gpu_memory_utilization, "tensor_parallel_size": o.tensor_parallel_size,
                                  "enforce_eager": o.enforce_eager}
        if cfg.max_model_len:
            kwargs["max_model_len"] = cfg.max_model_len
        pooler: dict[str, Any] = {}
        if cfg.embedding.pooling is not None:
            pooler["pooling_type"] = cfg.embedding.pooling.upper()
        if cfg.embedding.normalize is not None:
            pooler["use_activation"] = cfg.embedding.normalize  # an embed pooler's activation is its L2 normalisation
        if pooler:
            kwargs["pooler_config"] = PoolerConfig(**pooler)
        kwargs.update(o.extra)
        self.llm = LLM(**kwargs)
        model_config = self.llm.llm_engine.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.size = int(model_config.embedding_size)
        self.matryoshka = (bool(model_config.is_matryoshka), model_config.matryoshka_dimensions)
        self.tokenizer = self.llm.get_tokenizer()
        self.name = f"vllm-embed:{cfg.model}"

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> VllmEmbedEngine:
        return cls(cfg)

    def encode(self, prompts: Sequence[Prompt]) -> list[Tokens | Completion]:
        from batch_inference.engines.chat import encode_each

        return encode_each(self.tokenizer, prompts)

    def generate(self, prompts: Sequence[Prompt | Tokens], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Each prompt's vector from one ``LLM.embed`` call; a request vLLM would refuse fails alone."""
        from vllm import PoolingParams

        per_item = expand_params(prompts, params)
        out, ready = checked_requests(prompts, per_item, lambda p: self.encode([p])[0], self)
        items = list(ready)
        if items:
            try:
                results = self.llm.embed([{"prompt_token_ids": ready[i]} for i in items], use_tqdm=False,
                                         pooling_params=[PoolingParams(dimensions=per_item[i].dimensions) for i in items])
                for i, r in zip(items, results):
                    out[i] = embedding_completion(r.outputs.embedding, len(ready[i]))
            except Exception as exc:  # the call as a whole: every item of it fails retryable, the engine stays
                log.warning("LLM.embed failed for %d items: %s", len(items), exc)
                for i in items:
                    out[i] = Completion.failed(ErrorKind.ENGINE_ERROR.tag(f"{type(exc).__name__}: {exc}"), prompt_tokens=len(ready[i]))
        return [c for c in out if c is not None]

    def close(self) -> None:
        self.llm = None  # type: ignore[assignment]


def build_embed_engine(cfg: EngineConfig) -> TransformersEmbedEngine | VllmEmbedEngine:
    """The embedding engine of an ``engine.task: embed`` config (transformers or vLLM)."""
    if cfg.kind == "vllm":
        return VllmEmbedEngine.from_config(cfg)
    return TransformersEmbedEngine.from_config(cfg)
