"""``GenRequest``: one prompt on its way from a shard task to the engine.

Its own module so that the engine host and the streaming gate, which both carry it,
depend on it instead of on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batch_inference.engines import Prompt, SamplingParams


@dataclass(slots=True)
class GenRequest:
    """One prompt on its way through the batcher.

    ``cost`` is prompt tokens (exact, from the engine's tokenizer) plus ``max_tokens``:
    the KV cache grows with every decoded token, so the budget must count them. For
    task accounting the batcher's inference function fills ``engine_s`` (this request's
    token-weighted share of its batch's engine time) and ``fill`` (its batch's cost /
    budget); the streaming gate fills ``engine_s`` (its fair share of the engine's time
    while it was in flight) and ``fill`` (in-flight / capacity when it was admitted).
    A streaming engine tokenises for itself, so ``prompt_tokens`` is 0 there.
    """

    prompt: Prompt  # text or chat messages; the engine renders chat with its chat template
    params: SamplingParams
    prompt_tokens: int
    engine_s: float = 0.0
    fill: float = 0.0
    cost: int = field(init=False)

    def __post_init__(self) -> None:
        self.cost = self.prompt_tokens + self.params.max_tokens

    def estimate_tokens(self) -> int:
        return self.cost
