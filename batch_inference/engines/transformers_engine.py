"""The transformers engine: ``AutoModelForCausalLM`` with left-padded batched generate.

Runs the tiny offline model on CPU in tests and any causal LM on CUDA where present.
Per-item safety: each prompt is tokenised once (by the shard task through ``encode``, or
here when given text) and length-checked alone (an overlong prompt becomes a
``prompt_too_long`` error, its neighbours run); prompts are grouped by their
SamplingParams (seeds aside; ``bucketed`` and ``continuous`` also set output lengths aside)
and each group runs as ``generate`` calls (``TransformersOptions.batching``); if a whole call
raises, its items are retried one by one so a single bad item cannot fail the others.

LoRA (``transformers.lora``): peft attaches every adapter to the one base model at load,
and a request runs on the adapter it names or on the base model. Padded calls mix adapters
row by row (peft's ``adapter_names``, ``__base__`` for the base model; at most ``max_loras``
adapters a call); a continuous session runs one adapter, made active for its length.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from batch_inference.engines.base import (
    Completion,
    Prompt,
    SamplingParams,
    Tokens,
    adapter_error,
    combine_seeds,
    expand_params,
    group_by_params,
    token_counts,
    cut_at_stop,
    penalties_error,
    too_long_error,
)
from batch_inference.engines.chat import TokenizerCopy, encode_each, encode_prompts
from batch_inference.engines.config import EngineConfig, LoraOptions, TransformersOptions
from batch_inference.engines.lora import AdapterError, check_adapters
from batch_inference.rows import ErrorKind

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BASE_ADAPTER = "__base__"  # peft's adapter_names entry for a row on the base model


class TransformersEngine:
    """Blocking batched generation with a Hugging Face causal LM."""

    simulated = False
    greedy_ignores_seed = True  # greedy decoding (do_sample=False) uses no generator

    def __init__(
        self,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        num_threads: int | None = 1,
        max_model_len: int | None = None,
        options: TransformersOptions | None = None,
    ) -> None:
        self.options = options or TransformersOptions()
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if self.device == "cpu" and num_threads:
            # Process-wide: on small shared CPUs one thread per worker process beats
            # oversubscribing the cores (docs/engines.md, ``num_threads``).
            torch.set_num_threads(num_threads)
        torch_dtype = _DTYPES.get(dtype) or (torch.bfloat16 if self.device == "cuda" else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.model_max_length = 1 << 40  # lengths are checked per item below, against max_model_len
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        self.lora = self.options.lora
        self.adapters: tuple[str, ...] = tuple(self.lora.adapters) if self.lora is not None else ()
        self.model = (attach_adapters(base, self.lora) if self.lora is not None else base).to(self.device).eval()
        self.max_model_len = max_model_len or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.name = f"transformers:{model}"
        self._eos_ids = _eos_ids(self.model, self.tokenizer)
        self._counting = TokenizerCopy(self.tokenizer)  # encode runs on other threads than generate

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> TransformersEngine:
        assert cfg.model is not None  # EngineConfig guarantees it
        return cls(cfg.model, device=cfg.device, dtype=cfg.dtype, num_threads=cfg.num_threads, max_model_len=cfg.max_model_len,
                   options=cfg.transformers)

    def _encode(self, prompts: list[Prompt], tokenizer: Any = None) -> list[list[int]]:
        return encode_prompts(tokenizer or self.tokenizer, prompts)

    def encode(self, prompts: Sequence[Prompt]) -> list[Tokens | Completion]:
        """The token ids ``generate`` feeds the model, on a copy of the tokenizer (this runs on
        other threads than ``generate``)."""
        with self._counting as tokenizer:
            return encode_each(tokenizer, prompts)

    def count_tokens(self, prompts: list[Prompt]) -> list[int]:
        """Exact prompt token counts (0 for a prompt it cannot encode)."""
        return token_counts(self.encode(prompts))

    def generate(self, prompts: Sequence[Prompt | Tokens], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """``Tokens`` run as they are; a text or chat prompt is encoded here first."""
        per_item = expand_params(prompts, params)
        out: list[Completion | None] = [None] * len(prompts)
        raw = [i for i, p in enumerate(prompts) if not isinstance(p, Tokens)]
        fresh = dict(zip(raw, encode_each(self.tokenizer, [prompts[i] for i in raw]))) if raw else {}  # type: ignore[misc]
        encoded: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            tokens = prompt if isinstance(prompt, Tokens) else fresh[i]
            if isinstance(tokens, Completion):  # a prompt the tokenizer (or chat template) rejects fails alone
                out[i] = tokens
            elif err := too_long_error(len(tokens.ids), per_item[i].max_tokens, self.max_model_len):
                out[i] = Completion.failed(err, prompt_tokens=len(tokens.ids))
            elif not tokens.ids:
                out[i] = Completion.failed(ErrorKind.EMPTY_PROMPT.tag("the prompt has no tokens"))
            elif err := adapter_error(per_item[i].adapter, self.adapters):  # never run an unknown adapter's request on the base
                out[i] = Completion.failed(err, prompt_tokens=len(tokens.ids))
            elif err := penalties_error(per_item[i], "transformers"):
                out[i] = Completion.failed(err, prompt_tokens=len(tokens.ids))
            else:
                encoded[i] = list(tokens.ids)
        runnable = list(encoded)
        # Seeds do not split groups (the pool sends one per record): a group is sampled
        # with one generator seeded from all its items' seeds, so sampling is repeatable
        # for the same batch but depends on its composition (vLLM seeds per request).
        batching = self.options.batching
        keys = [per_item[i] if batching == "static" else _length_free(per_item[i]) for i in runnable]
        if batching != "continuous":  # a padded call mixes adapters per row; a continuous session runs one
            keys = [replace(k, adapter=None) for k in keys]
        for key, idx in group_by_params(keys, ignore_seed=True).items():
            for items in self._adapter_chunks([runnable[j] for j in idx], per_item):
                if batching == "continuous":
                    done = self._run_continuous(items, encoded, per_item)
                elif batching == "bucketed":
                    done = {}
                    for bucket in self.buckets(items, encoded, per_item):
                        done.update(zip(bucket, self._run_bucket([encoded[i] for i in bucket], [per_item[i] for i in bucket])))
                else:
                    p = replace(key, seed=combine_seeds([per_item[i].seed for i in items]))
                    done = dict(zip(items, self._run_group([encoded[i] for i in items], p, [per_item[i] for i in items])))
                for i, completion in done.items():
                    out[i] = completion
        return [c for c in out if c is not None]

    def _adapter_chunks(self, items: list[int], per_item: list[SamplingParams]) -> list[list[int]]:
        """``items`` cut so that no call mixes more than ``max_loras`` adapters (the base model
        is none): by adapter name, only when the group names more than that."""
        if self.lora is None or len({per_item[i].adapter for i in items} - {None}) <= self.lora.max_loras:
            return [items]
        chunks: list[list[int]] = []
        names: set[str] = set()
        for i in sorted(items, key=lambda i: (per_item[i].adapter is not None, per_item[i].adapter or "")):
            adapter = per_item[i].adapter
            if not chunks or (adapter is not None and adapter not in names and len(names) == self.lora.max_loras):
                chunks.append([])
                names = set()
            chunks[-1].append(i)
            if adapter is not None:
                names.add(adapter)
        return chunks

    def buckets(self, items: list[int], encoded: dict[int, list[int]], per_item: list[SamplingParams]) -> list[list[int]]:
        """Items sorted by (output, prompt) length, cut where a padded bucket would cost more
        than ``bucket_padding`` x its real tokens (a row pads to the bucket's longest)."""
        order = sorted(items, key=lambda i: (per_item[i].max_tokens, len(encoded[i])))
        buckets: list[list[int]] = []
        real = longest_prompt = longest_output = 0
        for i in order:
            prompt, output = len(encoded[i]), per_item[i].max_tokens
            grown = (len(buckets[-1]) + 1) * (max(longest_prompt, prompt) + max(longest_output, output)) if buckets else 0
            if not buckets or grown > self.options.bucket_padding * (real + prompt + output):
                buckets.append([])
                real = longest_prompt = longest_output = 0
            buckets[-1].append(i)
            real += prompt + output
            longest_prompt, longest_output = max(longest_prompt, prompt), max(longest_output, output)
        return buckets

    def _run_bucket(self, batch: list[list[int]], own: list[SamplingParams]) -> list[Completion]:
        """One call for rows that differ only in output length: run to the longest, trim each
        row to its own ``max_tokens``. Identical to separate calls for greedy: a row's token k
        depends on its tokens before k only, and EOS is allowed from the same step in both
        (``_length_free`` only merges rows with no minimum or with min >= max)."""
        longest = max(p.max_tokens for p in own)
        fixed = own[0].min_tokens >= own[0].max_tokens
        p = replace(own[0], max_tokens=longest, min_tokens=longest if fixed else own[0].min_tokens,
                    seed=combine_seeds([q.seed for q in own]))
        return self._run_group(batch, p, own)

    def _run_group(self, batch: list[list[int]], p: SamplingParams, own: list[SamplingParams]) -> list[Completion]:
        """One ``generate`` call with ``p``; ``own`` are the rows' own params (their lengths,
        stop strings and adapters)."""
        try:
            return self._generate_batch(batch, p, own)
        except Exception as exc:
            if len(batch) == 1:
                log.warning("generate failed for one item: %s", exc)
                return [Completion.failed(ErrorKind.ENGINE_ERROR.tag(f"{type(exc).__name__}: {exc}"), prompt_tokens=len(batch[0]))]
            log.warning("generate failed for a group of %d; retrying item by item: %s", len(batch), exc)
            return [self._run_group([ids], p, [own[k]])[0] for k, ids in enumerate(batch)]

    def _run_continuous(self, items: list[int], encoded: dict[int, list[int]], per_item: list[SamplingParams]) -> dict[int, Completion]:
        """One continuous-batching session for a group; each request decodes to its own length."""
        first = per_item[items[0]]
        if 0 < first.min_tokens < first.max_tokens or len(items) == 1:
            # transformers' continuous batching has no min_new_tokens (only none or, with EOS
            # off, exactly max): such groups, and single items, run as one padded call
            return {i: c for bucket in self.buckets(items, encoded, per_item)
                    for i, c in zip(bucket, self._run_bucket([encoded[i] for i in bucket], [per_item[i] for i in bucket]))}
        try:
            results = self._continuous([encoded[i] for i in items], [per_item[i] for i in items])
        except Exception as exc:  # the session itself failed: the padded path isolates items
            log.warning("continuous batching failed for %d items; running them padded: %s", len(items), exc)
            return {i: c for bucket in self.buckets(items, encoded, per_item)
                    for i, c in zip(bucket, self._run_bucket([encoded[i] for i in bucket], [per_item[i] for i in bucket]))}
        return {i: self._finish(r, encoded[i], per_item[i]) if isinstance(r, list)
                else Completion.failed(r, prompt_tokens=len(encoded[i])) for i, r in zip(items, results)}

    @torch.inference_mode()
    def _continuous(self, batch: list[list[int]], own: list[SamplingParams]) -> list[list[int] | str]:
        """New token ids per request (or its error) from a ``ContinuousBatchingManager``.

        The paged cache is sized from the requests (``num_blocks``): left to itself on CPU it
        sizes from *system* memory, enough to get a tiny model OOM-killed (docs/engines.md)."""
        p, page = own[0], 256
        fixed, sample = p.min_tokens >= p.max_tokens, p.temperature > 0
        gen = GenerationConfig(
            do_sample=sample, temperature=p.temperature if sample else None, top_p=p.top_p if sample else None, top_k=None,
            max_new_tokens=max(q.max_tokens for q in own), eos_token_id=self._eos_ids, pad_token_id=self.tokenizer.pad_token_id,
        )
        cfg = ContinuousBatchingConfig(
            page_size=page, num_blocks=sum(-(-(len(ids) + q.max_tokens) // page) for ids, q in zip(batch, own)),
            max_batch_tokens=self.options.max_batch_tokens, seed=combine_seeds([q.seed for q in own]) if sample else None,
        )
        with self._active_adapter(p.adapter), \
                self.model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cfg, warmup=False) as manager:
            ids = [manager.add_request(x, max_new_tokens=q.max_tokens, eos_token_id=-1 if fixed else self._eos_ids)
                   for x, q in zip(batch, own)]
            results: dict[str, Any] = {}
            while len(results) < len(ids):
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError(f"continuous batching stopped with {len(ids) - len(results)} requests unfinished")
        return [results[i].generated_tokens if results[i].error is None else ErrorKind.ENGINE_ERROR.tag(str(results[i].error)) for i in ids]

    @contextlib.contextmanager
    def _active_adapter(self, adapter: str | None) -> Iterator[None]:
        """``adapter`` (None: the base model) active for every forward inside, for a session
        whose rows cannot name their own (continuous batching)."""
        if self.lora is None:
            yield
        elif adapter is None:
            with self.model.disable_adapter():
                yield
        else:
            self.model.set_adapter(adapter, inference_mode=True)
            yield

    @torch.inference_mode()
    def _generate_batch(self, batch: list[list[int]], p: SamplingParams, own: list[SamplingParams]) -> list[Completion]:
        enc = self.tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt").to(self.device)
        kwargs: dict[str, Any] = {
            "max_new_tokens": p.max_tokens,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self._eos_ids,
        }
        if p.min_tokens:
            kwargs["min_new_tokens"] = p.min_tokens
        if p.temperature > 0:
            kwargs.update(do_sample=True, temperature=p.temperature, top_p=p.top_p, top_k=0)
            if p.seed is not None:
                torch.manual_seed(p.seed)  # one generator per group: sampling depends on the group
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if self.lora is not None:
            kwargs["adapter_names"] = [q.adapter or BASE_ADAPTER for q in own]
        generated = self.model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1] :].tolist()
        return [self._finish(ids[: q.max_tokens], prompt, q) for ids, prompt, q in zip(generated, batch, own)]

    def _finish(self, new_ids: list[int], prompt: list[int], p: SamplingParams) -> Completion:
        """Cut at EOS (the rest is padding) and at stop strings; decide the finish reason.

        After a stop string, ``completion_tokens`` is the re-tokenised kept text (exact
        up to token boundaries at the cut)."""
        n = next((k for k, t in enumerate(new_ids) if t in self._eos_ids), None)
        hit_eos = n is not None
        tokens = new_ids[: n if hit_eos else len(new_ids)]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        text, matched = cut_at_stop(text, p.stop)
        stopped = matched is not None
        completion_tokens = len(self.tokenizer([text], add_special_tokens=True)["input_ids"][0]) if stopped else len(tokens)
        reason = "stop" if hit_eos or stopped else "length"
        return Completion(text=text, prompt_tokens=len(prompt), completion_tokens=completion_tokens, finish_reason=reason,
                          stop_sequence=matched)

    def close(self) -> None:
        """Drop the model; frees GPU memory when on CUDA."""
        self.model = None  # type: ignore[assignment]
        if self.device == "cuda":
            torch.cuda.empty_cache()


def attach_adapters(model: Any, lora: LoraOptions) -> Any:
    """``model`` (a causal LM) wrapped by peft with every adapter of ``lora`` attached, by name.

    Each folder is read first as the preflight reads it (``check_adapters``), so a bad one is
    named here too rather than deep inside peft."""
    if problems := check_adapters(lora):
        raise AdapterError("; ".join(f"transformers.lora.adapters.{name}: {why}" for name, why in problems.items()))
    try:
        from peft import PeftModel
    except ImportError as exc:  # peft is in the cpu extra; an environment without it cannot serve adapters
        raise ImportError(f"transformers.lora needs peft ({exc}): pip install -e '.[cpu]'") from exc
    (first, path), *rest = lora.adapters.items()
    # on the CPU, beside the base model, until the engine moves them to its device together
    wrapped = PeftModel.from_pretrained(model, str(Path(path).expanduser()), adapter_name=first, torch_device="cpu")
    for name, path in rest:
        wrapped.load_adapter(str(Path(path).expanduser()), adapter_name=name, torch_device="cpu")
    return wrapped


def _length_free(p: SamplingParams) -> SamplingParams:
    """The grouping key of rows that may share a call whatever their output length: rows with
    no minimum, or with EOS off (min >= max); rows with 0 < min < max only with their like."""
    if p.min_tokens == 0:
        return replace(p, max_tokens=1)
    return replace(p, max_tokens=1, min_tokens=1) if p.min_tokens >= p.max_tokens else p


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]
