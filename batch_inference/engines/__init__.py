"""Engines: the protocol, the factory, and the tiny offline model builder.

Only light modules are imported here; torch/transformers/vllm load when an engine
that needs them is built (``build_engine``) or ``make_tiny_model`` runs.
"""

from __future__ import annotations

from batch_inference.engines.base import (
    ChatPrompt,
    Completion,
    Engine,
    EngineDeadError,
    EngineOccupancy,
    PrefixCacheStats,
    Prompt,
    ResponseFormat,
    SamplingParams,
    StreamingEngine,
    Tokens,
    greedy_ignores_seed,
    is_streaming,
    prefix_block_size,
    prefix_cache_stats,
    supports_structured_output,
)
from batch_inference.engines.config import EngineConfig, SimulatedOptions, TransformersOptions, VllmOptions
from batch_inference.engines.factory import build_engine
from batch_inference.engines.tiny_model import make_tiny_model  # imports torch only when called


__all__ = [
    "ChatPrompt",
    "Completion",
    "Engine",
    "EngineDeadError",
    "EngineOccupancy",
    "EngineConfig",
    "PrefixCacheStats",
    "Prompt",
    "ResponseFormat",
    "SamplingParams",
    "SimulatedOptions",
    "StreamingEngine",
    "Tokens",
    "TransformersOptions",
    "VllmOptions",
    "build_engine",
    "greedy_ignores_seed",
    "is_streaming",
    "make_tiny_model",
    "prefix_block_size",
    "prefix_cache_stats",
    "supports_structured_output",
]
