"""The parts of a prefix-order pass (``pipeline.placement``) that hold no I/O of their own:
what a signing pass counts (``SigningPass``, one ``SignedPart`` per slice), how the input is
sliced among worker processes (``input_slices``), and where the sorted records' shards end
(``shard_cuts``). ``pipeline.placement`` runs the pass and re-exports these names.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from batch_inference.engines.base import Prompt
from batch_inference.engines.blocks import BLOCK_HASH_BYTES
from batch_inference.prompting import InferConfig, RequestBuilder
from batch_inference.prompting.prefix import PrefixSigner, shared_blocks
from batch_inference.storage.sort import ExternalSort

SHARD_SLACK = 0.25  # a laid-out shard ends up to this share of shard_records early or late, between families


class PlacementError(RuntimeError):
    """The layout pass would lose or add records (it never commits then)."""


def record_prompt(builder: RequestBuilder, record: dict[str, Any]) -> Prompt | None:
    """The record's prompt, or None when it has none (its task gives it its error)."""
    try:
        return builder.prompt(record)
    except (KeyError, ValueError):
        return None


def batches(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while batch := list(itertools.islice(it, n)):
        yield batch


@dataclass
class SignedPart:
    """What signing one part of the input (in input order) counted: its first and last
    signatures join it to the parts either side."""

    records: int = 0
    blocks: int = 0
    shared_input: int = 0
    chat: int = 0  # records whose request is chat
    first: bytes | None = None
    last: bytes = b""
    sign_s: float = 0.0
    runs: list[str] = field(default_factory=list)  # sorted runs a worker spilled (ExternalSort.spill_runs)


@dataclass
class SigningPass:
    """One signing pass over the directory: its sort and what it counted."""

    sort: ExternalSort
    records: int = 0
    blocks: int = 0
    shared_input: int = 0
    chat: int = 0  # records whose request is chat
    shared_sorted: int = 0
    common: int = 0  # blocks every record shares (prompting.prefix.common_blocks): a family lies past them
    sign_s: float = 0.0

    @property
    def gain(self) -> float:
        return (self.shared_sorted - self.shared_input) / self.blocks if self.blocks else 0.0


@dataclass(frozen=True)
class SliceJob:
    """A worker process's part of a parallel pass: consecutive input shards, signed and
    spilled as sorted runs into the pass's spill folder under its own name."""

    index: int
    shards: tuple[str, ...]
    storage_options: dict[str, Any] | None
    signer: PrefixSigner
    infer: InferConfig
    spill_url: str
    run_bytes: int
    keep_lines: bool


def input_slices(shards: list[tuple[str, int]], n: int) -> list[tuple[str, ...]]:
    """``shards`` ((url, records), in order) as up to ``n`` runs of consecutive shards of about equal records."""
    total = sum(r for _, r in shards)
    out: list[tuple[str, ...]] = []
    cur: list[str] = []
    done = 0
    for url, records in shards:
        cur.append(url)
        done += records
        if done * n >= total * (len(out) + 1) and len(out) < n - 1:
            out.append(tuple(cur))
            cur = []
    if cur:
        out.append(tuple(cur))
    return out


@dataclass
class SigningWorkers:
    """The process pool a parallel layout pass signs in, and how it splits the input."""

    pool: Executor
    slices: list[tuple[str, ...]]
    storage_options: dict[str, Any] | None
    infer: InferConfig
    run_bytes: int  # each worker's: the pass's run_bytes shared out, so memory stays about one run


def shard_cuts(keys: Iterable[bytes], per: int, slack: int) -> Iterator[tuple[int, int]]:
    """Where the sorted records' shards end: (records, blocks shared across the cut) per shard.

    A shard holds ``per`` records give or take ``slack``, and ends at the boundary in that
    window where the records either side share the fewest leading blocks (ties: the one
    nearest ``per``): between two families when the window holds one (no more than the
    blocks every record shares: ``prompting.prefix``),
    so that a family smaller than a shard sits in one shard, whose task and whose worker
    compute its prefix once; a family larger than a shard is cut at ``per``. Streams: it
    holds one window of depths, never the records. The last shard reports 0.
    """
    slack = max(0, min(slack, per // 4))
    lo, hi = per - slack, per + slack
    size = 0  # records of the current shard seen so far
    window: list[int] = []  # blocks shared across the boundary before the shard's record lo + j
    prev: bytes | None = None
    for key in keys:
        if prev is not None and size >= lo:
            window.append(shared_blocks(prev, key))
            if size >= hi or (window[-1] == 0 and size >= per):  # no later boundary can be better
                best = min(range(len(window)), key=lambda j: (window[j], abs(lo + j - per)))
                yield lo + best, window[best]
                size -= lo + best
                window = []
        size += 1
        prev = key
    if size:
        yield size, 0


def shard_slack(records_per_shard: int) -> int:
    """How many records a shard cut between families may end early or late."""
    return min(int(records_per_shard * SHARD_SLACK), records_per_shard // 4)


def shard_limit(records_per_shard: int) -> int:
    """The most records a shard cut between families holds (the writer's limit for ``write_cut``)."""
    return records_per_shard + shard_slack(records_per_shard)


def counted(p: SigningPass, items: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
    """``items`` (sorted) passed through, counting ``p.shared_sorted`` and ``p.common`` on the way."""
    prev = b""
    for n, (key, line) in enumerate(items):
        shared = shared_blocks(prev, key)
        p.shared_sorted += shared
        # in sorted order the blocks every record shares are the fewest two neighbours share
        p.common = len(key) // BLOCK_HASH_BYTES if n == 0 else min(p.common, shared)
        prev = key
        yield key, line
