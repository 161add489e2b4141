"""Partitions: one dynamic key per pipeline run, and run x round for the round assets.

Rounds cannot be a self-dependency in the asset graph (pending[N] <- rejected[N-1] is a
cycle), so each round is a partition of the per-round assets. The round assets use a
two-dimensional partitioning, ``pipeline`` x ``round``, whose string keys read
``"<run>|r00"``; both dimensions are dynamic. The ``pipeline`` dimension is the same
definition the run-level assets use, so Dagster maps ``sharded[run]`` to
``pending[run|rNN]`` and ``approved[run|*]`` to ``results[run]`` by itself: lineage
works with built-in mappings, no custom PartitionMapping.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import dagster as dg

from batch_inference.defs.keys import DEFAULT

# The project's own pipeline's; a component's pipeline has its own (``PipelineKeys.runs`` ...).
RUNS = DEFAULT.runs
ROUND_NUMBERS = DEFAULT.round_numbers
ROUNDS = DEFAULT.rounds

_ROUND_RE = re.compile(r"^r(\d{2})$")


class RoundKey(NamedTuple):
    """A round partition: pipeline run name and round number."""

    run: str
    round: int

    @property
    def round_label(self) -> str:
        return round_label(self.round)

    def partition_key(self) -> dg.MultiPartitionKey:
        return dg.MultiPartitionKey({"pipeline": self.run, "round": self.round_label})

    def __str__(self) -> str:
        return str(self.partition_key())


def round_label(r: int) -> str:
    """``r00`` .. ``r99`` (the spec caps ``max_rounds`` at 99)."""
    if not 0 <= r <= 99:
        raise ValueError(f"round {r} out of range 0..99")
    return f"r{r:02d}"


def parse_round_key(key: str | dg.MultiPartitionKey) -> RoundKey:
    """``"nightly|r03"`` (or its MultiPartitionKey) -> ``RoundKey("nightly", 3)``."""
    if isinstance(key, dg.MultiPartitionKey):
        dims = key.keys_by_dimension
        run, label = dims["pipeline"], dims["round"]
    else:
        run, sep, label = str(key).rpartition("|")
        if not sep:
            raise ValueError(f"round partition key {key!r} is not '<run>|rNN'")
    match = _ROUND_RE.match(label)
    if not match or not run:
        raise ValueError(f"round partition key {key!r} is not '<run>|rNN'")
    return RoundKey(run, int(match.group(1)))
