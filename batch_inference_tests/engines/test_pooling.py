"""Embedding engines (engines.pooling) on the tiny embedding model: the vectors are the model's
pooled hidden states, a batch answers as each row alone, and what a request cannot have fails it alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batch_inference.engines import EngineConfig, SamplingParams, build_engine
from batch_inference.engines.pooling import TransformersEmbedEngine, model_pooling
from batch_inference.pool.request import GenRequest

EMBED = SamplingParams(embed=True)


@pytest.fixture(scope="module")
def embedder(tiny_embed_dir: Path) -> TransformersEmbedEngine:
    engine = build_engine({"kind": "transformers", "model": str(tiny_embed_dir), "task": "embed", "device": "cpu"})
    assert isinstance(engine, TransformersEmbedEngine)
    return engine


def test_the_tiny_model_declares_mean_pooling_normalised_and_matryoshka(tiny_embed_dir: Path) -> None:
    config = json.loads((tiny_embed_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaModel"] and config["matryoshka_dimensions"] == [32, 64, 128]
    assert model_pooling(tiny_embed_dir, decoder=True) == ("mean", True)
    assert model_pooling(tiny_embed_dir / "nowhere", decoder=True) == ("last", True)  # no sentence-transformers files


def test_vectors_are_the_mean_of_the_hidden_states_normalised(embedder: TransformersEmbedEngine) -> None:
    tokens = embedder.encode(["the quick brown fox", "a batch of prompts is tokenised, padded and run together"])
    got = embedder.generate(tokens, EMBED)
    for t, c in zip(tokens, got):
        with torch.inference_mode():
            hidden = embedder.model(input_ids=torch.tensor([list(t.ids)])).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)
        assert c.error is None and c.text == "" and c.completion_tokens == 0 and c.prompt_tokens == len(t.ids)
        assert c.embedding is not None and len(c.embedding) == 128
        assert torch.allclose(torch.tensor(c.embedding), want, atol=1e-5)  # padding in the batch changed nothing


def test_dimensions_truncate_then_normalise_and_an_unlisted_one_fails_alone(embedder: TransformersEmbedEngine) -> None:
    tokens = embedder.encode(["the quick brown fox"] * 3)
    full, short, bad = embedder.generate(tokens, [EMBED, SamplingParams(embed=True, dimensions=32), SamplingParams(embed=True, dimensions=33)])
    assert short.embedding is not None and len(short.embedding) == 32
    want = torch.nn.functional.normalize(torch.tensor(full.embedding)[:32], dim=-1)  # type: ignore[index]
    assert torch.allclose(torch.tensor(short.embedding), want, atol=1e-6)
    assert bad.error is not None and bad.error.startswith("bad_request: dimensions 33") and "[32, 64, 128]" in bad.error


def test_dimensions_on_a_model_that_is_not_matryoshka_fail_and_options_override_pooling(tiny_model_dir: Path) -> None:
    engine = build_engine({"kind": "transformers", "model": str(tiny_model_dir), "task": "embed", "device": "cpu",
                           "embedding": {"pooling": "cls", "normalize": False}})
    assert (engine.pooling, engine.normalize) == ("cls", False)
    tokens = engine.encode(["the quick brown fox"] * 2)
    plain, dims = engine.generate(tokens, [EMBED, SamplingParams(embed=True, dimensions=32)])
    with torch.inference_mode():
        first = engine.model(input_ids=torch.tensor([list(tokens[0].ids)])).last_hidden_state[0, 0]
    assert torch.allclose(torch.tensor(plain.embedding), first, atol=1e-5)  # CLS: the first token's state, not normalised
    assert dims.error is not None and "does not support Matryoshka" in dims.error


def test_what_an_embedding_engine_cannot_run_fails_alone(embedder: TransformersEmbedEngine) -> None:
    tokens = embedder.encode(["fine", "", "x " * 3000, "also fine"])
    out = embedder.generate(tokens, [EMBED, EMBED, EMBED, SamplingParams(max_tokens=8)])
    assert out[0].embedding is not None
    assert out[1].error is not None and out[1].error.startswith("empty_prompt")
    assert out[2].error is not None and out[2].error.startswith("prompt_too_long")
    assert out[3].error is not None and out[3].error.startswith("bad_request: this engine embeds")


def test_an_embedding_request_costs_its_prompt_alone() -> None:
    assert GenRequest("p", EMBED, 40).cost == 40  # no decode: max_tokens is not budgeted
    assert GenRequest("p", SamplingParams(max_tokens=16), 40).cost == 56


def test_embed_config_rules() -> None:
    with pytest.raises(ValueError, match="needs a model that embeds"):
        EngineConfig(kind="simulated", task="embed")
    with pytest.raises(ValueError, match="dimensions"):
        SamplingParams(dimensions=8)  # not an embedding request


def test_cli_make_model_embed_builds_the_tiny_embedding_model(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from batch_inference.cli.engine_cmds import make_model

    result = CliRunner().invoke(make_model, [str(tmp_path / "e"), "--embed"])
    assert result.exit_code == 0, result.output
    assert "tiny embedding model" in result.output
    assert json.loads((tmp_path / "e" / "config.json").read_text())["architectures"] == ["LlamaModel"]
    assert model_pooling(tmp_path / "e", decoder=True) == ("mean", True)
