"""The tiny offline model: deterministic build, loadable layout, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from batch_inference.engines.tiny_model import make_tiny_model


def test_layout_and_config(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (512, 128, 2)
    assert (config["num_key_value_heads"], config["head_dim"], config["max_position_embeddings"]) == (1, 64, 2048)
    tok_cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg or (tiny_model_dir / "chat_template.jinja").exists()


def test_deterministic_per_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    other = make_tiny_model(tmp_path / "other", seed=1)
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    assert (again / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


@pytest.mark.slow  # builds a model: imports torch and transformers
def test_cli_make_model(tmp_path: Path) -> None:
    from batch_inference.cli.engine_cmds import make_model

    result = CliRunner().invoke(make_model, [str(tmp_path / "m"), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m" / "model.safetensors").exists() and "tiny model written" in result.output
