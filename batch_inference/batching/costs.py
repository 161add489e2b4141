"""What a batcher is given: the model call (``ProcessFn``), and how a record's cost is known
(an explicit cost, the batcher's ``CostEstimatorFn``, or the record's own ``estimate_cost``
/ ``estimate_tokens``). Shared by ``DynamicBatcher`` and ``TokenBatcher``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

T = TypeVar("T")
R = TypeVar("R")

ProcessFn = Callable[[list[T]], Awaitable[Sequence[R]]]
CostEstimatorFn = Callable[[T], float]


@runtime_checkable
class CostEstimator(Protocol):
    """A record that knows its own cost (checked after an explicit cost and the
    batcher's ``cost_estimator``)."""

    def estimate_cost(self) -> float: ...


@runtime_checkable
class TokenEstimator(Protocol):
    """A record that knows its own token count (``TokenBatcher`` checks it first)."""

    def estimate_tokens(self) -> int: ...


@dataclass
class Prompt:
    """The reference design's convenience record: ~4 characters per token."""

    text: str

    def estimate_tokens(self) -> int:
        return len(self.text) // 4 + 1
