"""LoRA adapters on the transformers engine (peft): every adapter attached once to the base
model, each request on the adapter it names or on the base model, a call mixing at most
``max_loras`` adapters; answers compared against peft's own ``PeftModel.generate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batch_inference.engines import SamplingParams, build_engine
from batch_inference.engines.lora import AdapterError
from batch_inference_tests.engines.peft_reference import greedy_texts

PROMPTS = ["The quick brown fox", "Question: what is the capital of France?", "Summarise the article in one",
           "Large language models generate", "def add(a, b):", "Translate the following sentence",
           "Once upon a time", "The weather today is"]
# two or more rows per adapter, so a continuous session runs on each (a lone row runs padded)
ADAPTERS = [None, "a1", "a2", "a1", "a2", None, "a1", "a2"]


def lora_engine(model: Path, adapters: dict[str, Path], **options: Any):
    lora = {"adapters": {name: str(path) for name, path in adapters.items()}, "max_loras": options.pop("max_loras", 2)}
    return build_engine({"kind": "transformers", "model": str(model), "device": "cpu", "transformers": {**options, "lora": lora}})


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> dict[str, Any]:
    """Each prompt's ids, and peft's answers on each row's adapter and on the base model."""
    engine = lora_engine(tiny_model_dir, tiny_adapters)
    ids = [t.ids for t in engine.encode(PROMPTS)]
    engine.close()
    lengths = [8 + i % 3 for i in range(len(PROMPTS))]  # bucketed rows differ in output length
    return {"ids": ids, "lengths": lengths,
            "want": greedy_texts(tiny_model_dir, tiny_adapters, list(zip(ids, ADAPTERS, lengths))),
            "base": greedy_texts(tiny_model_dir, tiny_adapters, [(i, None, n) for i, n in zip(ids, lengths)])}


@pytest.mark.slow  # continuous: a session per adapter, ~5 s
@pytest.mark.parametrize("batching", ["static", "bucketed", "continuous"])
def test_per_record_adapters_answer_as_peft_with_that_adapter(tiny_model_dir: Path, tiny_adapters: dict[str, Path],
                                                              reference: dict[str, Any], batching: str) -> None:
    engine = lora_engine(tiny_model_dir, tiny_adapters, batching=batching)
    params = [SamplingParams(max_tokens=n, temperature=0.0, seed=k, adapter=a)
              for k, (n, a) in enumerate(zip(reference["lengths"], ADAPTERS))]
    out = engine.generate([*PROMPTS, PROMPTS[0]], [*params, SamplingParams(max_tokens=4, adapter="zz")])
    engine.close()
    assert all(c.error is None for c in out[:-1]), [c.error for c in out]
    assert [c.text for c in out[:-1]] == reference["want"]
    assert out[-1].error.startswith("bad_request: LoRA adapter 'zz' is not loaded on this engine: it serves a1, a2")
    # the adapters change the answers (the comparison is not the base model's against itself)
    assert sum(w != b for w, b, a in zip(reference["want"], reference["base"], ADAPTERS) if a) >= 5


def test_base_rows_answer_as_the_engine_without_adapters(tiny_engine, reference: dict[str, Any]) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in reference["lengths"]]
    out = tiny_engine.generate(PROMPTS, params)  # a plain engine (no lora options) on the same base model
    assert [c.text for c in out] == reference["base"]
    assert [w for w, a in zip(reference["want"], ADAPTERS) if a is None] == [b for b, a in zip(reference["base"], ADAPTERS) if a is None]


@pytest.mark.parametrize(("max_loras", "calls"), [(1, [{"a1"}, {"a2"}]), (2, [{"a1", "a2"}])])
def test_a_generate_call_mixes_at_most_max_loras_adapters(tiny_model_dir: Path, tiny_adapters: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch, max_loras: int, calls: list) -> None:
    engine = lora_engine(tiny_model_dir, tiny_adapters, batching="static", max_loras=max_loras)
    seen: list[list[str]] = []
    generate = engine.model.generate

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(list(kwargs["adapter_names"]))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine.model, "generate", recording)
    mixed = ["a2", None, "a1", "a2", "a1", None]
    out = engine.generate(PROMPTS[:6], [SamplingParams(max_tokens=3, adapter=a) for a in mixed])
    engine.close()
    assert all(c.error is None for c in out)
    # the base model is no adapter: its rows ride along in the first call
    assert [set(names) - {"__base__"} for names in seen] == calls
    assert sum(names.count("__base__") for names in seen) == 2 and sum(map(len, seen)) == 6


def test_a_bad_adapter_folder_fails_the_engine_build_naming_it(tiny_model_dir: Path, tiny_adapters: dict[str, Path],
                                                               tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"transformers.lora.adapters.gone: adapter folder .*gone.* does not exist"):
        lora_engine(tiny_model_dir, {"a1": tiny_adapters["a1"], "gone": tmp_path / "gone"})
