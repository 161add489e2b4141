"""The one engine factory. Engine modules are imported lazily: building the simulated
engine never imports torch, and vllm is imported only when asked for."""

from __future__ import annotations

from typing import Any

from batch_inference.engines.base import Engine, StreamingEngine
from batch_inference.engines.config import EngineConfig


def build_engine(config: EngineConfig | dict[str, Any]) -> Engine | StreamingEngine:
    """Build the engine a config names (a dict is validated into ``EngineConfig`` first).

    Most kinds build a blocking ``Engine``; ``is_streaming(engine)`` tells the caller
    when it got a ``StreamingEngine`` (vLLM by default, the simulated decode model with
    continuous scheduling), which must then be started on the event loop that will
    drive it (``await engine.start()``); the pool's ``EngineHost`` does this.
    """
    cfg = config if isinstance(config, EngineConfig) else EngineConfig.model_validate(config)
    if cfg.task == "embed":  # blocking on both kinds: an embedding has no decode for streaming to overlap
        from batch_inference.engines.pooling import build_embed_engine

        return build_embed_engine(cfg)
    if cfg.kind == "simulated":
        from batch_inference.engines import simulated

        if cfg.simulated.cost_model == "linear":
            return simulated.LinearSimulatedEngine.from_config(cfg)
        if cfg.simulated.scheduling == "blocking":
            return simulated.DecodeBatchEngine.from_config(cfg)
        return simulated.DecodeStreamingEngine.from_config(cfg)
    if cfg.kind == "transformers":
        from batch_inference.engines.transformers_engine import TransformersEngine

        return TransformersEngine.from_config(cfg)
    if cfg.kind == "vllm":
        from batch_inference.engines.vllm_engine import VllmEngine, VllmStreamingEngine

        return VllmStreamingEngine.from_config(cfg) if cfg.vllm.streaming else VllmEngine.from_config(cfg)
    raise ValueError(f"unknown engine kind {cfg.kind!r}")  # unreachable: pydantic checks kind
