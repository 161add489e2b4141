"""Seeded output lengths: how many tokens a simulated answer runs to.

A record's length comes from a generator seeded by the record itself (``record_rng``),
so it is the same whatever batch, engine or process draws it.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Literal

LengthDistribution = Literal["fixed", "geometric", "pareto"]


def record_rng(*parts: object) -> random.Random:
    """A generator seeded by a stable hash of ``parts`` (no process hash salt)."""
    digest = hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def draw_output_tokens(
    rng: random.Random,
    distribution: LengthDistribution,
    mean: float,
    *,
    max_tokens: int,
    min_tokens: int = 0,
    pareto_alpha: float = 1.5,
) -> int:
    """One output length (tokens) from the distribution, within [max(1, min_tokens), max_tokens].

    ``mean`` is the uncapped mean. ``geometric``: memoryless stop (P(stop) = 1/mean per
    token), like an EOS that can come at any step. ``pareto``: heavy-tailed (shape
    ``pareto_alpha``; alpha <= 2 has infinite variance), a few very long answers.
    """
    if distribution == "fixed":
        n = round(mean)
    elif distribution == "geometric":
        p = 1.0 / max(mean, 1.0)
        n = 1 if p >= 1 else 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
    elif distribution == "pareto":
        scale = mean * (pareto_alpha - 1) / pareto_alpha if pareto_alpha > 1 else mean
        n = math.ceil(scale * rng.paretovariate(pareto_alpha))
    else:
        raise ValueError(f"unknown output length distribution {distribution!r}")
    return max(1, min_tokens, min(n, max_tokens))
