"""LoRA adapters: the tiny adapter make-model builds, reading adapter folders, the simulated engine's adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from batch_inference.engines import SamplingParams, build_engine
from batch_inference.engines.config import EngineConfig, LoraOptions
from batch_inference.engines.lora import AdapterError, check_adapters, max_rank, read_adapter


def test_make_model_builds_a_tiny_adapter_for_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    from batch_inference.cli.engine_cmds import make_model

    result = CliRunner().invoke(make_model, [str(tmp_path / "a"), "--adapter-for", str(tiny_model_dir), "--rank", "4", "--seed", "3"])
    assert result.exit_code == 0, result.output
    info = read_adapter(str(tmp_path / "a"))
    assert (info.rank, info.target_modules, info.base_model) == (4, ("q_proj", "v_proj"), str(tiny_model_dir.resolve()))
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        shapes = {k: tuple(f.get_tensor(k).shape) for k in keys}
    # both layers, q (128 -> 128) and v (128 -> 64, one KV head of 64), A then B, none of B zero
    assert len(keys) == 8 and shapes["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] == (64, 4)
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 128)
    again = CliRunner().invoke(make_model, [str(tmp_path / "b"), "--adapter-for", str(tiny_model_dir), "--rank", "4", "--seed", "3"])
    assert again.exit_code == 0
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == (tmp_path / "b" / "adapter_model.safetensors").read_bytes()


def test_adapter_folders_are_checked_and_named(tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    not_lora = tmp_path / "ia3"
    not_lora.mkdir()
    (not_lora / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "r": 8}))
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    lora = LoraOptions(adapters={"ok": str(tiny_adapters["a1"]), "missing": str(tmp_path / "nope"), "empty": str(empty),
                                 "ia3": str(not_lora), "noweights": str(no_weights)}, max_lora_rank=4)
    problems = check_adapters(lora)
    assert set(problems) == {"ok", "missing", "empty", "ia3", "noweights"}
    assert "rank 8 > max_lora_rank 4" in problems["ok"] and "does not exist" in problems["missing"]
    assert "no adapter_config.json" in problems["empty"] and "not LORA" in problems["ia3"] and "no adapter weights" in problems["noweights"]
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter(str(tmp_path / "nope"))
    assert max_rank(LoraOptions(adapters={k: str(v) for k, v in tiny_adapters.items()})) == 8
    assert check_adapters(LoraOptions(adapters={k: str(v) for k, v in tiny_adapters.items()})) == {}


def test_the_simulated_engine_answers_per_adapter() -> None:
    engine = build_engine({"kind": "simulated", "simulated": {"latency_a_s": 0, "latency_b_s": 0,
                                                              "lora": {"adapters": {"a1": "/unread", "a2": "/unread"}}}})
    params = [SamplingParams(max_tokens=8, seed=1, adapter=a) for a in (None, "a1", "a2", "a1", "zz")]
    out = engine.generate(["same prompt"] * 5, params)
    base, a1, a2, a1_again, unknown = out
    assert len({base.text, a1.text, a2.text}) == 3 and a1.text == a1_again.text
    assert unknown.error.startswith("bad_request: LoRA adapter 'zz' is not loaded on this engine: it serves a1, a2")
    plain = build_engine({"kind": "simulated", "simulated": {"latency_a_s": 0, "latency_b_s": 0}})
    assert plain.generate(["same prompt"], SamplingParams(max_tokens=8, seed=1))[0].text == base.text  # no adapter: the base model


def test_lora_options_are_each_kinds_own() -> None:
    cfg = EngineConfig.model_validate({"kind": "transformers", "model": "/m", "transformers": {"lora": {"adapters": {"a": "/a"}}}})
    assert cfg.adapters == ("a",) and cfg.lora is cfg.transformers.lora
    cfg = EngineConfig.model_validate({"kind": "vllm", "model": "/m", "vllm": {"lora": {"adapters": {"a": "/a"}, "max_loras": 2}}})
    assert cfg.adapters == ("a",) and EngineConfig.model_validate({"kind": "vllm", "model": "/m"}).adapters == ()
    # another kind's block is not this engine's: a vllm engine given transformers.lora serves none
    other = EngineConfig.model_validate({"kind": "vllm", "model": "/m", "transformers": {"lora": {"adapters": {"a": "/a"}}}})
    assert other.adapters == ()


def test_the_transformers_engine_without_lora_fails_an_adapters_request_alone(tiny_engine) -> None:
    out = tiny_engine.generate(["hello", "hello"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, adapter="a1")])
    assert out[0].error is None and out[1].error.startswith("bad_request: LoRA adapter 'a1' is not loaded on this engine")
