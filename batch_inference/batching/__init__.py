"""Batching layer: merge records from many producer coroutines into cost-budgeted
batches for one model call. See docs/batching.md."""

from batch_inference.batching.batcher import (
    CostEstimator,
    CostEstimatorFn,
    DynamicBatcher,
    ProcessFn,
    Prompt,
    TokenBatcher,
    TokenEstimator,
)
from batch_inference.batching.stats import BatchStats, WindowStats

__all__ = [
    "BatchStats",
    "CostEstimator",
    "CostEstimatorFn",
    "DynamicBatcher",
    "ProcessFn",
    "Prompt",
    "TokenBatcher",
    "TokenEstimator",
    "WindowStats",
]
