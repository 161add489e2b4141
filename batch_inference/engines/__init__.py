"""Engines: the protocol, the factory, and the tiny offline model builder.

Only light modules are imported here; torch/transformers/vllm load when an engine
that needs them is built (``build_engine``) or the model builder runs.
"""

from __future__ import annotations

from pathlib import Path

from batch_inference.engines.base import Completion, Engine, SamplingParams
from batch_inference.engines.config import EngineConfig, SimulatedOptions, VllmOptions
from batch_inference.engines.factory import build_engine


def make_tiny_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Build the tiny offline Llama model (imports torch/transformers on call)."""
    from batch_inference.engines.tiny_model import make_tiny_model as _make

    return _make(out_dir, seed=seed)


__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "SimulatedOptions",
    "VllmOptions",
    "build_engine",
    "make_tiny_model",
]
