"""Prefix-aware layout: the sharded input rewritten so records that share a prefix sit together.

An engine's prefix cache holds a tiny part of a large dataset's distinct prefixes, so the
order requests arrive in decides how often a prefix is computed again. ``layout_by_prefix``
signs every record (``prompting.prefix``: its rendered request's block-hash chain), sorts
the records by signature through the storage layer (``storage.sort.ExternalSort``: sorted
runs spilled under the run, then merged; memory is one run, never the dataset) and
rewrites the directory in that order, cut into shards of ``shard_records`` as sharding
cuts them. Sorting by the chain is a depth-first walk of the prefix tree: every family of
records sharing a prefix is contiguous, and within it the sub-families sharing a longer one.

The records are only moved: ids, attempts and every field stay as they are, so
conservation holds by construction (and is checked: as many records out as in). It runs
before any round, over ``sharded/``; recompaction keeps the order (the rejected records of
a round, concatenated in shard order, are a subsequence of a sorted sequence).

Work is skipped when it cannot pay: the rewrite happens only when prefix order shares at
least ``min_gain`` of the blocks more than input order does (a prefix every record shares,
such as a template's preamble, is cached in any order).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

from batch_inference.engines.base import Prompt
from batch_inference.pipeline.summaries import LayoutSummary
from batch_inference.prompting import InferConfig, RequestBuilder
from batch_inference.prompting.prefix import PrefixSigner, shared_blocks
from batch_inference.storage import JsonlDir
from batch_inference.storage.sort import ExternalSort

log = logging.getLogger(__name__)

SIGN_BATCH = 1024  # records per tokenizer call


class PlacementError(RuntimeError):
    """The layout pass would lose or add records (it never commits then)."""


def record_prompt(builder: RequestBuilder, record: dict[str, Any]) -> Prompt | None:
    """The record's prompt, or None when it has none (its task gives it its error)."""
    try:
        return builder.prompt(record)
    except (KeyError, ValueError):
        return None


def _batches(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while batch := list(itertools.islice(it, n)):
        yield batch


def layout_by_prefix(
    url: str, *, signer: PrefixSigner, infer: InferConfig, records_per_shard: int, spill_url: str,
    storage_options: dict[str, Any] | None = None, min_gain: float = 0.01, run_bytes: int = 128 << 20,
) -> LayoutSummary:
    """Rewrite the JsonlDir at ``url`` in prefix order, when that pays (blocking: a CPU pass).

    The directory is read in full (signed, spilled as sorted runs) before it is rewritten;
    a process killed while rewriting leaves it without a manifest, which the shard step
    takes as "shard again".
    """
    d = JsonlDir(url, storage_options=storage_options)
    man = d.manifest()
    if man is None:
        raise PlacementError(f"{d.url} is not committed: nothing to lay out")
    builder = RequestBuilder(infer)
    sign_s = 0.0
    records = blocks = shared_input = shared_sorted = 0
    t0 = time.perf_counter()
    with ExternalSort(spill_url, storage_options=storage_options, run_bytes=run_bytes) as sort:
        prev = b""
        for batch in _batches(d.iter_parsed_lines_sync(), SIGN_BATCH):  # each record with its own line: moved as it is
            t = time.perf_counter()
            signatures = signer.sign([record_prompt(builder, rec) for rec, _ in batch])
            sign_s += time.perf_counter() - t
            for (_, line), sig in zip(batch, signatures):
                shared_input += shared_blocks(prev, sig.blocks)
                prev = sig.blocks
                blocks += sig.n_blocks
                sort.add(sig.blocks, line)
            records += len(batch)
        if records != man.records:
            raise PlacementError(f"{d.url}: read {records} records, its manifest says {man.records}")
        sort.finish()
        prev = b""
        for key, _ in sort.iter_sorted():
            shared_sorted += shared_blocks(prev, key)
            prev = key
        gain = (shared_sorted - shared_input) / blocks if blocks else 0.0
        applied = blocks > 0 and gain >= min_gain and gain > 0
        if applied:
            reason = f"prefix order shares {gain:.1%} of the blocks more than input order (>= min_gain {min_gain:.1%})"
            with d.writer_sync(max_records_per_shard=records_per_shard, compression=man.compression) as w:
                w.write_lines(line for _, line in sort.iter_sorted())
            written = w.records
            if written != records:  # pragma: no cover - the sort hands back what it took
                raise PlacementError(f"{d.url}: rewrote {written} of {records} records")
        else:
            reason = (f"kept input order: prefix order would share {gain:.1%} of the blocks more (< min_gain {min_gain:.1%})"
                      if blocks else "kept input order: no request has a full block")
        runs, levels = sort.spilled_runs, sort.merge_levels
    summary = LayoutSummary(
        applied=applied, reason=reason, signature=signer.tokenizer.name, block_size=signer.block_size,
        max_blocks=signer.max_blocks, records=records, blocks=blocks, shared_input=shared_input,
        shared_sorted=shared_sorted, gain=round(gain, 4), sign_s=round(sign_s, 3),
        sort_s=round(time.perf_counter() - t0 - sign_s, 3), runs=runs, merge_levels=levels,
    )
    log.info("placement %s: %s (%d records, %d blocks, signing %.1f s, sorting %.1f s)",
             d.url, reason, records, blocks, summary.sign_s, summary.sort_s)
    return summary
