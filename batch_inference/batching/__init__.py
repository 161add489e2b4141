"""Batching layer: merge records from many producer coroutines into cost-budgeted
batches for one model call. See docs/batching.md."""

from batch_inference.batching.batcher import DynamicBatcher
from batch_inference.batching.costs import CostEstimator, CostEstimatorFn, ProcessFn, Prompt, TokenEstimator
from batch_inference.batching.stats import BatchStats, WindowStats
from batch_inference.batching.tokens import TokenBatcher

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
