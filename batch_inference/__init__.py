"""batch_inference: batch LLM inference at 100M+ samples with the GPU kept busy.

Public names are imported lazily (PEP 562) so that ``import batch_inference`` stays
cheap: a worker or a CLI call pays only for the layers it touches. The names of the
reference design (``JsonlFile``, ``JsonlDir``, ``DynamicBatcher``, ``TokenBatcher``,
``dispatch_bounded``) are kept so code written for it ports with an import change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batch_inference._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # Dagster: a pipeline in a user's dg project (the dagster_dg_cli.registry_modules entry point)
    "BatchInferenceComponent": "batch_inference.components",
    # storage
    "JsonlFile": "batch_inference.storage",
    "JsonlDir": "batch_inference.storage",
    "CheckpointStore": "batch_inference.storage",
    "MalformedRecordError": "batch_inference.storage",
    "CorruptShardError": "batch_inference.storage",
    # batching
    "DynamicBatcher": "batch_inference.batching",
    "TokenBatcher": "batch_inference.batching",
    "BatchStats": "batch_inference.batching",
    # engines and judges
    "SamplingParams": "batch_inference.engines",
    "Completion": "batch_inference.engines",
    "EngineConfig": "batch_inference.engines",
    "build_engine": "batch_inference.engines",
    "make_tiny_model": "batch_inference.engines",
    "JudgeConfig": "batch_inference.judges",
    "build_judge": "batch_inference.judges",
    "PromptTemplate": "batch_inference.judges",
    # pool
    "dispatch_bounded": "batch_inference.pool",
    "PoolClient": "batch_inference.pool",
    "LocalLauncher": "batch_inference.pool",
    # pipeline
    "PipelineSpec": "batch_inference.pipeline",
    "run_pipeline": "batch_inference.pipeline",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from batch_inference.components import BatchInferenceComponent
    from batch_inference.batching import BatchStats, DynamicBatcher, TokenBatcher
    from batch_inference.engines import Completion, EngineConfig, SamplingParams, build_engine, make_tiny_model
    from batch_inference.judges import JudgeConfig, PromptTemplate, build_judge
    from batch_inference.pipeline import PipelineSpec, run_pipeline
    from batch_inference.pool import LocalLauncher, PoolClient, dispatch_bounded
    from batch_inference.storage import CheckpointStore, CorruptShardError, JsonlDir, JsonlFile, MalformedRecordError
