"""vLLM engine: pure helpers always; the engine itself only where vLLM and a GPU exist."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from batch_inference.engines import SamplingParams
from batch_inference.engines.vllm_engine import completion_from_output, split_runnable, vllm_sampling_kwargs


def test_sampling_kwargs_are_explicit() -> None:
    kw = vllm_sampling_kwargs(SamplingParams(max_tokens=9, seed=3, stop=["\n"], min_tokens=2))
    assert kw == {"max_tokens": 9, "min_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 3, "stop": ["\n"]}
    assert vllm_sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9))["top_p"] == 0.9
    assert "stop" not in vllm_sampling_kwargs(SamplingParams())


def test_split_runnable_filters_overlong_and_empty() -> None:
    params = [SamplingParams(max_tokens=4)] * 3
    runnable, errors = split_runnable([[1, 2], [1] * 10, []], params, max_model_len=10)
    assert runnable == [0]
    assert errors[1].error.startswith("prompt_too_long") and errors[1].prompt_tokens == 10
    assert errors[2].error.startswith("empty_prompt")


def test_completion_from_output() -> None:
    def out(reason: str) -> SimpleNamespace:
        return SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[SimpleNamespace(text="hi", token_ids=[7, 8], finish_reason=reason)])

    c = completion_from_output(out("length"))
    assert (c.text, c.prompt_tokens, c.completion_tokens, c.finish_reason) == ("hi", 3, 2, "length")
    assert completion_from_output(out("abort")).finish_reason == "error"


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed (optional extra, GPU only)")
def test_vllm_generates_tiny_model(tiny_model_dir) -> None:  # pragma: no cover - GPU machines only
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from batch_inference.engines import build_engine

    engine = build_engine({"kind": "vllm", "model": str(tiny_model_dir), "max_model_len": 256, "vllm": {"gpu_memory_utilization": 0.2}})
    out = engine.generate(["hello", "word " * 300, "bye"], SamplingParams(max_tokens=8, min_tokens=8))
    assert out[1].error.startswith("prompt_too_long") and out[0].completion_tokens == 8 and out[2].error is None
    engine.close()
