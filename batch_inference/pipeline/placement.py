"""Prefix-aware layout: the sharded input rewritten so records that share a prefix sit together.

An engine's prefix cache holds a tiny part of a large dataset's distinct prefixes, so the
order requests arrive in decides how often a prefix is computed again. ``layout_by_prefix``
signs every record (``prompting.prefix``: its rendered request's block-hash chain), sorts
the records by signature through the storage layer (``storage.sort.ExternalSort``: sorted
runs spilled under the run, then merged; memory is one run, never the dataset) and
rewrites the directory in that order, cut into shards of about ``shard_records``: each
ends at the boundary between two families nearest its size, within ``SHARD_SLACK`` of it
(``shard_cuts``), so that a family smaller than a shard sits in one shard, and so on one
worker (``pipeline.affinity`` names a shard by its first record's family: a family cut in
two could go to two workers and be computed on each). A family is
``prompting.prefix``'s: records sharing a block past the ``common`` blocks every record
shares (a template's preamble, however long), the one definition the cuts and the pool's
dispatch use. Sorting by the chain is a depth-first walk of the prefix tree: every family
of records sharing a prefix is contiguous, and within it the sub-families sharing a
longer one.

The records are only moved: ids, attempts and every field stay as they are, so
conservation holds by construction (and is checked: as many records out as in). It runs
before any round, over ``sharded/``; recompaction keeps the order (the rejected records of
a round, concatenated in shard order, are a subsequence of a sorted sequence) and, when the
layout was applied, cuts its shards between families the same way (``FamilyCuts``:
``write_cut`` over the records signed again, one batch at a time).

Work is skipped when it cannot pay: a first pass signs every record by its text (cheap,
no tokenizer) and decides; records are tokenised and the directory rewritten only when
prefix order shares at least ``min_gain`` of the blocks more than input order does (a
prefix every record shares, such as a template's preamble, is cached in any order). A
shared text prefix is a shared token prefix, so the text decides as the tokens would.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import orjson

from batch_inference.engines.base import ChatPrompt
from batch_inference.pipeline.prefix_pass import (
    SHARD_SLACK,
    PlacementError,
    SignedPart,
    SigningPass,
    SigningWorkers,
    SliceJob,
    batches,
    counted,
    input_slices,
    record_prompt,
    shard_cuts,
    shard_limit,
    shard_slack,
)
from batch_inference.pipeline.summaries import LayoutSummary
from batch_inference.prompting import InferConfig, RequestBuilder
from batch_inference.prompting.prefix import CharTokens, PlainTextTokens, PrefixSigner, shared_blocks, text_tokens
from batch_inference.storage import JsonlDir, JsonlFile
from batch_inference.storage._io import ShardStats
from batch_inference.storage.sort import ExternalSort
from batch_inference.storage.urls import join

__all__ = [  # the pass's parts live in pipeline.prefix_pass; callers import them from here as before
    "PARALLEL_MIN_RECORDS", "SHARD_SLACK", "SIGN_BATCH", "WRITE_LINES", "FamilyCuts", "PlacementError", "input_slices",
    "layout_by_prefix", "layout_workers", "record_prompt", "rewrite", "sign_pass", "shard_cuts", "shard_limit", "shard_slack", "signed_lines",
    "write_cut",
]

log = logging.getLogger(__name__)

SIGN_BATCH = 1024  # records per tokenizer call
WRITE_LINES = 1024  # lines the rewrite hands the writer at once
# A worker process signs at least this many records (its start, imports and tokenizer load,
# is ~2-4 s; the text gate pass signs ~15-120 µs a record): smaller inputs are signed in the driver's process.
PARALLEL_MIN_RECORDS = 100_000


def _sign_into(items: Iterator[tuple[dict[str, Any], bytes]], signer: PrefixSigner, builder: RequestBuilder,
               sort: ExternalSort, keep_lines: bool, part: SignedPart) -> None:
    """Sign ``(record, line)`` items, add (signature, line) to ``sort`` (the line only when kept), count into ``part``."""
    for batch in batches(items, SIGN_BATCH):  # each record with its own line: moved as it is
        t = time.perf_counter()
        prompts = [record_prompt(builder, rec) for rec, _ in batch]
        signatures = signer.sign(prompts)
        part.sign_s += time.perf_counter() - t
        part.chat += sum(isinstance(p, ChatPrompt) for p in prompts)
        for (_, line), sig in zip(batch, signatures):
            if part.first is None:
                part.first = sig.blocks
            else:
                part.shared_input += shared_blocks(part.last, sig.blocks)
            part.last = sig.blocks
            part.blocks += sig.n_blocks
            sort.add(sig.blocks, line if keep_lines else b"")
        part.records += len(batch)


def _sign_slice(job: SliceJob) -> SignedPart:
    """Run in a worker process: sign the job's shards in order, spill them as sorted runs."""
    sort = ExternalSort(job.spill_url, storage_options=job.storage_options, run_bytes=job.run_bytes, name=f"w{job.index:05d}-")
    part = SignedPart()
    builder = RequestBuilder(job.infer)
    for url in job.shards:
        _sign_into(JsonlFile(url, storage_options=job.storage_options).iter_parsed_lines_sync(), job.signer, builder, sort,
                   job.keep_lines, part)
    part.runs = sort.spill_runs()
    return part


def sign_pass(d: JsonlDir, signer: PrefixSigner, builder: RequestBuilder, sort: ExternalSort, *, keep_lines: bool,
               workers: SigningWorkers | None = None, count: bool = True) -> SigningPass:
    """Sign every record, spill (signature, line) into ``sort`` (the line only when kept), count sharing.

    With ``workers``, each worker process signs a slice of consecutive shards into sorted
    runs of its own, which ``sort`` adopts in input order: equal signatures keep input
    order, so the sorted records are the serial pass's, byte for byte. ``count=False``
    leaves the sorted-order figures to the rewrite (``rewrite(count=True)``).
    """
    p = SigningPass(sort)
    if workers is None:
        parts = [SignedPart()]
        _sign_into(d.iter_parsed_lines_sync(), signer, builder, sort, keep_lines, parts[0])
    else:
        t = time.perf_counter()
        jobs = [SliceJob(i, urls, workers.storage_options, signer, workers.infer, sort.url, workers.run_bytes, keep_lines)
                for i, urls in enumerate(workers.slices)]
        parts = list(workers.pool.map(_sign_slice, jobs))
        for part in parts:
            sort.adopt(part.runs, part.records)
        p.sign_s = time.perf_counter() - t  # the workers' wall: reading, signing and spilling, side by side
    prev: bytes | None = None
    for part in parts:
        p.records += part.records
        p.blocks += part.blocks
        p.shared_input += part.shared_input
        p.chat += part.chat
        if part.first is not None:
            if prev is not None:
                p.shared_input += shared_blocks(prev, part.first)
            prev = part.last
    if workers is None:
        p.sign_s = parts[0].sign_s
    sort.finish(workers.pool if workers is not None else None)  # a level's merges side by side in the workers
    if count:
        for _ in counted(p, sort.iter_sorted()):
            pass
    return p


def layout_workers(requested: int | None, records: int, shards: int, min_records: int | None = None) -> int:
    """Processes a layout pass over ``records`` in ``shards`` input shards signs in: the
    ``requested`` (None: the driver's cores), no more than there are shards, and one only
    for each ``min_records`` records (a process costs its start: a small input stays on
    the driver's own process)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = cores if requested is None else requested
    per = PARALLEL_MIN_RECORDS if min_records is None else min_records
    return max(1, min(n, shards, records // max(1, per)))


def layout_by_prefix(
    url: str, *, signer: PrefixSigner, infer: InferConfig, records_per_shard: int, spill_url: str,
    storage_options: dict[str, Any] | None = None, min_gain: float = 0.01, run_bytes: int = 128 << 20,
    workers: int | None = None, parallel_min_records: int | None = None,
    on_shard: Callable[[ShardStats, int], None] | None = None,
) -> LayoutSummary:
    """Rewrite the JsonlDir at ``url`` in prefix order, when that pays (blocking: a CPU pass).

    First a cheap pass signs every record by its text (``CharTokens``: no tokenizer; at the
    characters a token the signer's text was measured at, ``prompting.prefix.text_tokens``) and
    sorts the signatures alone: when prefix order would not share ``min_gain`` more, it
    stops there and the directory keeps its order (no record tokenised). Otherwise, with a
    tokenizer-backed ``signer``, a second pass signs every record by the engine's tokens and
    sorts the records by those; with a text signer the first pass's sort is the order, and
    so it is with ``PlainTextTokens`` (``auto``) when no record's request is chat (the
    first pass keeps the lines then, when the records decide whether they are chat).

    Both passes are spread over ``workers`` processes (``layout_workers``: None is the
    driver's cores; inputs under ``parallel_min_records`` a worker stay in this process),
    each signing consecutive shards into sorted runs that the merge takes in input order:
    the result is the serial pass's, byte for byte. The merge, the sharing counts and the
    rewrite stay in this process.

    The directory is read in full (signed, spilled as sorted runs) before it is rewritten;
    a process killed while rewriting leaves it without a manifest, which the shard step
    takes as "shard again". ``on_shard(stats, common)`` is told about each rewritten shard as
    it commits (on the writing thread), with the blocks every record so far shares: its
    final order is known then, so round 0 can start on it (``pipeline.stream``). A pass that
    keeps the input's order rewrites nothing and tells nothing.
    """
    d = JsonlDir(url, storage_options=storage_options)
    man = d.manifest()
    if man is None:
        raise PlacementError(f"{d.url} is not committed: nothing to lay out")
    builder = RequestBuilder(infer)
    t0 = time.perf_counter()
    by_text = isinstance(signer.tokenizer, CharTokens)
    auto = isinstance(signer.tokenizer, PlainTextTokens)  # plain prompts by text: signed as the gate signs them
    gate_signer = signer if by_text else PrefixSigner(text_tokens(signer.tokenizer), block_size=signer.block_size,
                                                      max_blocks=signer.max_blocks)  # text at the model's characters a token
    sign_s = 0.0
    cuts_shared = 0
    n_workers = layout_workers(workers, man.records, len(man.shards),
                               PARALLEL_MIN_RECORDS if parallel_min_records is None else parallel_min_records)
    pool = (ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("spawn"))  # no fork of a threaded driver
            if n_workers > 1 else nullcontext())
    with pool, ExternalSort(join(spill_url, "gate"), storage_options=storage_options, run_bytes=run_bytes) as gate_sort:
        par = None
        if isinstance(pool, Executor):
            shards = [(join(d.url, sh["name"]), int(sh["records"])) for sh in man.shards]
            par = SigningWorkers(pool, input_slices(shards, n_workers), storage_options, infer, max(1 << 20, run_bytes // n_workers))
        gate = sign_pass(d, gate_signer, builder, gate_sort, workers=par,
                          keep_lines=by_text or (auto and builder.chat is not True))  # the records may all be plain
        sign_s += gate.sign_s
        if gate.records != man.records:
            raise PlacementError(f"{d.url}: read {gate.records} records, its manifest says {man.records}")
        text_order = by_text or (auto and gate.chat == 0)  # the gate's order is the final one
        final, applied = gate, gate.blocks > 0 and gate.gain >= min_gain and gate.gain > 0
        if applied and not text_order:
            gate_sort.clear()
            with ExternalSort(join(spill_url, "tokens"), storage_options=storage_options, run_bytes=run_bytes) as token_sort:
                # its gain was the gate's to decide: its figures are counted while it is rewritten
                final = sign_pass(d, signer, builder, token_sort, keep_lines=True, workers=par, count=False)
                sign_s += final.sign_s
                cuts_shared = rewrite(d, final, records_per_shard, man.compression, count=True, on_shard=on_shard)
        elif applied:
            cuts_shared = rewrite(d, final, records_per_shard, man.compression, on_shard=on_shard)
        runs, levels = final.sort.spilled_runs, final.sort.merge_levels
    if applied:
        reason = f"prefix order shares {final.gain:.1%} of the blocks more than input order (>= min_gain {min_gain:.1%})"
    elif gate.blocks:
        reason = f"kept input order: prefix order would share {gate.gain:.1%} of the blocks more (< min_gain {min_gain:.1%})"
    else:
        reason = "kept input order: no request has a full block"
    summary = LayoutSummary(
        applied=applied, reason=reason, signature=(signer if final is not gate or text_order else gate_signer).tokenizer.name,
        block_size=signer.block_size, max_blocks=signer.max_blocks, records=final.records, blocks=final.blocks,
        shared_input=final.shared_input, shared_sorted=final.shared_sorted, gain=round(final.gain, 4),
        sign_s=round(sign_s, 3), sort_s=round(time.perf_counter() - t0 - sign_s, 3), runs=runs, merge_levels=levels,
        text_gain=round(gate.gain, 4), cuts_shared=cuts_shared, common_blocks=final.common, workers=n_workers,
        chars_per_token=gate_signer.tokenizer.chars,  # type: ignore[attr-defined]  # the gate's: CharTokens
    )
    log.info("layout %s: %s (%d records, %d blocks, signing %.1f s on %d process%s, sorting %.1f s)",
             d.url, reason, summary.records, summary.blocks, summary.sign_s, n_workers, "es" if n_workers > 1 else "",
             summary.sort_s)
    return summary


def signed_lines(signer: PrefixSigner, builder: RequestBuilder, records: Iterable[tuple[dict[str, Any], bytes]]) -> Iterator[tuple[bytes, bytes]]:
    """``(signature blocks, line)`` for each ``(record, line)``, signed ``SIGN_BATCH`` at a time."""
    for batch in batches(iter(records), SIGN_BATCH):
        signatures = signer.sign([record_prompt(builder, rec) for rec, _ in batch])
        for (_, line), sig in zip(batch, signatures):
            yield sig.blocks, line


def write_cut(w: Any, items: Iterable[tuple[bytes, bytes]], records_per_shard: int, common: int = 0) -> int:
    """Write ``(signature blocks, line)`` pairs, in prefix order, to the directory writer
    ``w`` (opened with ``max_records_per_shard=shard_limit(records_per_shard)``), ending each
    shard where ``shard_cuts`` says; returns the cuts inside a family (the records either
    side share more than the ``common`` blocks every record does: a family larger than the
    window).

    Memory: lines wait only while a cut could still fall before them (the window); the
    ones certain to sit before the shard's earliest cut are written as they come.
    """
    return sum(shared > common for shared in _write_cuts(w, items, records_per_shard))


def _write_cuts(w: Any, items: Iterable[tuple[bytes, bytes]], records_per_shard: int) -> list[int]:
    """``write_cut``'s writing; returns the blocks shared across each cut (one int a shard)."""
    slack = shard_slack(records_per_shard)
    lo = records_per_shard - slack  # no shard ends before this many records
    pending: list[bytes] = []  # read, not yet written: the current shard's last lines and the next one's first
    written = 0  # of the current shard
    cuts: list[int] = []

    def keys() -> Iterator[bytes]:
        nonlocal written
        for key, line in items:
            pending.append(line)
            if len(pending) >= WRITE_LINES and written + len(pending) <= lo:
                w.write_lines(pending)
                written += len(pending)
                pending.clear()
            yield key

    for size, shared in shard_cuts(keys(), records_per_shard, slack):
        rest = size - written
        w.write_lines(pending[:rest])
        del pending[:rest]
        w.cut()
        written = 0
        cuts.append(shared)
    return cuts


@dataclass(frozen=True)
class FamilyCuts:
    """Shards cut between families for a pass that rewrites records already in prefix order
    (recompaction: a round's rejected records, concatenated in shard order, are a
    subsequence of the laid-out order), with the layout's own signer and cuts; ``common``:
    the blocks every record of the layout shares (``LayoutSummary.common_blocks``)."""

    signer: PrefixSigner
    infer: InferConfig
    common: int = 0

    def write(self, w: Any, records: Iterable[dict[str, Any]], records_per_shard: int) -> int:
        """Write ``records`` to ``w`` (opened with ``shard_limit``) cut by ``write_cut``; returns its count."""
        lines = ((rec, orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE)) for rec in records)
        return write_cut(w, signed_lines(self.signer, RequestBuilder(self.infer), lines), records_per_shard, self.common)


def rewrite(d: JsonlDir, p: SigningPass, records_per_shard: int, compression: Any, *, count: bool = False,
             on_shard: Callable[[ShardStats, int], None] | None = None) -> int:
    """Write the sorted records over ``d``, cut between families (``write_cut``); returns its count.

    ``count``: the pass's sorted-order figures are counted while writing (one read of the
    merged runs instead of two: the merge is the part of the pass left on the driver).
    ``on_shard(stats, common)``: each shard as it commits, with ``p.common`` so far."""
    items = p.sort.iter_sorted()
    told = (lambda stats: on_shard(stats, p.common)) if on_shard is not None else None
    with d.writer_sync(max_records_per_shard=shard_limit(records_per_shard), compression=compression, on_shard=told) as w:
        cuts = _write_cuts(w, counted(p, items) if count else items, records_per_shard)
    if w.records != p.records:  # pragma: no cover - the sort hands back what it took
        raise PlacementError(f"{d.url}: rewrote {w.records} of {p.records} records")
    return sum(shared > p.common for shared in cuts)
