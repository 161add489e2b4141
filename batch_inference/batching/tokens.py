"""``TokenBatcher``: the ``DynamicBatcher`` with its budget in tokens (``target_batch_tokens``,
records' ``estimate_tokens()``), as the workers' engine host uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from batch_inference.batching.batcher import DynamicBatcher
from batch_inference.batching.costs import CostEstimatorFn, ProcessFn, R, T


class TokenBatcher(DynamicBatcher[T, R]):
    """``DynamicBatcher`` with token names: the budget is ``target_batch_tokens``, and
    records may implement ``estimate_tokens()`` (checked before ``estimate_cost()``)."""

    _protocol_methods = ("estimate_tokens", "estimate_cost")

    def __init__(
        self,
        inference_fn: ProcessFn[T, R] | None = None,
        *,
        target_batch_tokens: float | None = None,
        max_batch_size: int = 256,
        min_batch_size: int = 1,
        batch_timeout_s: float = 0.05,
        prefetch_batches: int = 2,
        max_queue_size: int = 5_000,
        token_estimator: CostEstimatorFn[T] | None = None,
        default_token_estimate: float | None = None,
        strict_budget: bool = False,
        padded_cost: bool = False,
        stats_window: int = 100,
        process_fn: ProcessFn[T, R] | None = None,
        cost_estimator: CostEstimatorFn[T] | None = None,
        target_batch_cost: float = 32_000,
        default_cost: float = 1,
    ) -> None:
        fn = inference_fn or process_fn
        if fn is None:
            raise TypeError("TokenBatcher needs inference_fn (or process_fn)")
        super().__init__(
            fn,
            target_batch_cost=target_batch_tokens if target_batch_tokens is not None else target_batch_cost,
            max_batch_size=max_batch_size,
            min_batch_size=min_batch_size,
            batch_timeout_s=batch_timeout_s,
            prefetch_batches=prefetch_batches,
            max_queue_size=max_queue_size,
            cost_estimator=token_estimator or cost_estimator,
            default_cost=default_token_estimate if default_token_estimate is not None else default_cost,
            strict_budget=strict_budget,
            padded_cost=padded_cost,
            stats_window=stats_window,
        )

    async def submit(  # type: ignore[override]
        self, record: T, estimated_tokens: float | None = None, *, estimated_cost: float | None = None
    ) -> asyncio.Future[R]:
        return await super().submit(record, estimated_tokens if estimated_tokens is not None else estimated_cost)

    async def submit_many(  # type: ignore[override]
        self,
        records: Iterable[T],
        estimated_tokens: Sequence[float] | None = None,
        *,
        estimated_costs: Sequence[float] | None = None,
    ) -> list[asyncio.Future[R]]:
        return await super().submit_many(records, estimated_tokens if estimated_tokens is not None else estimated_costs)
