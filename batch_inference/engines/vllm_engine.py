"""The vLLM engine (optional extra ``vllm``, GPU, its own environment).

Uses the offline ``LLM.generate`` with ``TokensPrompt``: each prompt is tokenised once
with the engine's tokenizer, overlong prompts become per-item ``prompt_too_long`` errors
*before* the call (one overlong prompt otherwise aborts the whole ``LLM.generate``),
and every request gets its own ``vllm.SamplingParams`` (vLLM seeds per request, so a
record's sample does not depend on its batch). Temperature is always passed explicitly
(vLLM's default is 1.0). Chat prompts are rendered with the model's chat template
(``engines.chat``), the same tokens as vLLM's own chat path; a ``ResponseFormat`` becomes
vLLM's structured outputs (``StructuredOutputsParams``), so the reply is constrained, not
checked afterwards. The pure helpers below are unit-tested without vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from batch_inference.engines.base import ChatPrompt, Completion, Prompt, SamplingParams, expand_params, too_long_error
from batch_inference.engines.chat import ChatTemplateError, TokenizerCopy, encode_chat
from batch_inference.engines.config import EngineConfig

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
    token_ids: list[list[int]], params: list[SamplingParams], max_model_len: int
) -> tuple[list[int], dict[int, Completion]]:
    """Indices that may go to vLLM, and the per-item errors for the rest."""
    runnable: list[int] = []
    errors: dict[int, Completion] = {}
    for i, (ids, p) in enumerate(zip(token_ids, params)):
        if not ids:
            errors[i] = Completion.failed("empty_prompt: the prompt has no tokens")
        elif err := too_long_error(len(ids), p.max_tokens, max_model_len):
            errors[i] = Completion.failed(err, prompt_tokens=len(ids))
        else:
            runnable.append(i)
    return runnable, errors


def completion_from_output(output: Any) -> Completion:
    """A ``vllm.RequestOutput`` as a Completion (finish reasons other than stop/length are errors)."""
    first = output.outputs[0]
    n_prompt = len(output.prompt_token_ids or [])
    if first.finish_reason in ("stop", "length"):
        return Completion(first.text, n_prompt, len(first.token_ids), first.finish_reason)
    return Completion.failed(f"engine_error: finish_reason={first.finish_reason}", prompt_tokens=n_prompt)


class VllmEngine:
    """Blocking offline vLLM; one ``LLM`` per worker process."""

    simulated = False
    structured_output = True  # vLLM's structured outputs constrain decoding

    def __init__(self, cfg: EngineConfig) -> None:
        from vllm import LLM  # optional extra: imported only when this engine is built

        opts = cfg.vllm
        self._llm = LLM(
            model=cfg.model,
            dtype=cfg.dtype,
            seed=cfg.seed,
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            tensor_parallel_size=opts.tensor_parallel_size,
            enforce_eager=opts.enforce_eager,
            **opts.extra,
        )
        self.tokenizer = self._llm.get_tokenizer()  # generate's (LLM.generate detokenizes with it too)
        self._counting = TokenizerCopy(self.tokenizer)  # count_tokens runs on other threads than generate
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self.name = f"vllm:{cfg.model}"

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> VllmEngine:
        return cls(cfg)

    def _encode(self, prompt: Prompt, tokenizer: Any = None) -> list[int]:
        tokenizer = tokenizer or self.tokenizer
        if isinstance(prompt, ChatPrompt):
            return encode_chat(tokenizer, prompt)
        return list(tokenizer.encode(prompt))

    def count_tokens(self, prompts: list[Prompt]) -> list[int]:
        """Prompt token counts on a copy of the tokenizer (never generate's, from another thread)."""
        counts = []
        with self._counting as tokenizer:
            for p in prompts:
                try:
                    counts.append(len(self._encode(p, tokenizer)))
                except Exception:  # generate gives this prompt its error
                    counts.append(0)
        return counts

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        per_item = expand_params(prompts, params)
        token_ids: list[list[int]] = []
        tokenizer_errors: dict[int, Completion] = {}
        for i, prompt in enumerate(prompts):
            try:
                token_ids.append(self._encode(prompt))
            except ChatTemplateError as exc:  # fails alone
                token_ids.append([])
                tokenizer_errors[i] = Completion.failed(str(exc))
            except Exception as exc:  # fails alone
                token_ids.append([])
                tokenizer_errors[i] = Completion.failed(f"tokenizer_error: {type(exc).__name__}: {exc}")
        runnable, errors = split_runnable(token_ids, per_item, self.max_model_len)
        errors.update(tokenizer_errors)
        runnable = [i for i in runnable if i not in tokenizer_errors]
        results: dict[int, Completion] = dict(errors)
        if runnable:
            requests = [TokensPrompt(prompt_token_ids=token_ids[i]) for i in runnable]
            sampling = [VllmSamplingParams(**vllm_sampling_kwargs(per_item[i])) for i in runnable]
            try:
                outputs = self._llm.generate(requests, sampling_params=sampling, use_tqdm=False)
                for i, output in zip(runnable, outputs):
                    results[i] = completion_from_output(output)
            except Exception as exc:  # the whole call failed: every runnable item carries the reason
                log.warning("vLLM generate failed for %d prompts: %s", len(runnable), exc)
                for i in runnable:
                    results[i] = Completion.failed(f"engine_error: {type(exc).__name__}: {exc}", len(token_ids[i]))
        return [results[i] for i in range(len(prompts))]

    def close(self) -> None:
        """Drop the LLM so its GPU memory can be reclaimed."""
        self._llm = None  # type: ignore[assignment]
