"""``GenRequest``: one prompt on its way from a shard task to the engine.

Its own module so that the engine host and the streaming gate, which both carry it,
depend on it instead of on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batch_inference.engines import Prompt, SamplingParams, Tokens


@dataclass(slots=True)
class GenRequest:
    """One prompt on its way through the batcher or the streaming gate.

    ``prompt`` is the engine's ``Tokens`` from the shard task's one ``encode`` (text or
    chat messages are encoded by the engine itself). ``cost`` is prompt tokens plus
    ``max_tokens`` (prompt tokens alone for an embedding request): the KV cache grows with every decoded token, so the budget must count
    them. For task accounting the batcher's inference function fills ``engine_s`` (this
    request's token-weighted share of its batch's engine time) and ``fill`` (its batch's
    cost / budget); the streaming gate fills ``engine_s`` (its fair share of the engine's
    time while it was in flight) and ``fill`` (in-flight / capacity when it was admitted).
    """

    prompt: Prompt | Tokens
    params: SamplingParams
    prompt_tokens: int
    engine_s: float = 0.0
    fill: float = 0.0
    cost: int = field(init=False)

    def __post_init__(self) -> None:
        # an embedding request decodes nothing: its prompt is all it costs
        self.cost = self.prompt_tokens + (0 if self.params.embed else self.params.max_tokens)

    def estimate_tokens(self) -> int:
        return self.cost
