"""What a spec's input and prompts look like, before it runs: record count and prompt tokens."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from itertools import islice
from dataclasses import dataclass
from typing import Any

from batch_inference.pipeline.accounting import InputAccount
from batch_inference.pipeline.inputs import evenly_spaced
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.storage import JsonlDir, JsonlFile, input_format, open_source
from batch_inference.storage.parquet import ParquetSource


PARQUET_SAMPLE_ROWS = 200_000  # rows of a Parquet input read for the sample (its count is the footers')


def _parquet(spec: PipelineSpec) -> ParquetSource | None:
    """The input's Parquet reader when it is Parquet (its footers read), else None."""
    if input_format(spec.input, spec.storage_options or None) != "parquet":
        return None
    source = open_source(spec.input, spec.storage_options or None)
    return source if isinstance(source, ParquetSource) else None


@dataclass(frozen=True)
class InputSize:
    records: int
    how: str  # "manifest" | "counted" | "Parquet footers" | "estimated from N records"
    sample: list[dict[str, Any]]
    sampled: str = "the whole input"  # where the sample was drawn from
    account: InputAccount | None = None  # the lines read, when the input was read whole (``pipeline.accounting``)


SAMPLE_SEED = 20_260_601  # a fixed seed: the same input gives the same sample, so plans repeat
MANIFEST_SAMPLE_SHARDS = 16  # shards read for a sample of a directory with a manifest


def _reservoir(records: Iterator[dict[str, Any]], k: int) -> tuple[int, list[dict[str, Any]]]:
    """(records seen, a uniform sample of ``k`` of them in input order): one pass, k in memory."""
    rng = random.Random(SAMPLE_SEED)
    picked: list[tuple[int, dict[str, Any]]] = []
    n = 0
    for n, rec in enumerate(records, 1):
        if len(picked) < k:
            picked.append((n, rec))
        else:
            j = rng.randrange(n)
            if j < k:
                picked[j] = (n, rec)
    return n, [rec for _, rec in sorted(picked, key=lambda p: p[0])]


def _spread(d: JsonlDir, k: int) -> tuple[list[dict[str, Any]], str]:
    """``k`` records from evenly spaced shards of a manifest directory, each read whole.

    A prefix of the input is not the input: sorted or grouped inputs (by task, by length,
    by source) put unlike records at the end. Reading up to ``MANIFEST_SAMPLE_SHARDS``
    shards spread over the directory keeps the cost bounded at any size.
    """
    shards = d.shards()
    if not shards:
        return [], "the whole input"
    chosen = evenly_spaced(len(shards), MANIFEST_SAMPLE_SHARDS)
    per = max(1, -(-k // len(chosen)))
    sample: list[dict[str, Any]] = []
    for i in chosen:
        _, recs = _reservoir(shards[i].iter_records_sync(), per)
        sample.extend(recs)
    where = "the whole input" if len(chosen) == len(shards) else f"{len(chosen)} of {len(shards)} shards, evenly spaced"
    return sample[:k], where


def _counted(src: JsonlFile | JsonlDir, account: InputAccount) -> Iterator[dict[str, Any]]:
    """The records of ``src``, its malformed lines and duplicate ids counted in ``account``
    (the one rule: ``pipeline.accounting``), never raised: a run quarantines them."""
    numbered = src.iter_numbered_sync(on_error="quarantine", quarantine=account.count_malformed)
    return (rec for _, rec in account.counting(numbered))


def input_size(spec: PipelineSpec, *, sample: int = 500, count_limit_bytes: int = 256 << 20) -> InputSize:
    """The input's record count (manifest, count, or estimate) and ``sample`` records drawn
    across the whole input (uniformly where the input is read whole anyway)."""
    opts = spec.storage_options or None
    src = spec.input
    if (pq_src := _parquet(spec)) is not None:  # rows from the footers; the sample from the first rows read
        n_read, records = _reservoir(islice(pq_src.iter_records_sync(), PARQUET_SAMPLE_ROWS), sample)
        where = "the whole input" if n_read == pq_src.rows else f"the first {n_read:,} rows"
        return InputSize(pq_src.rows, "Parquet footers", records, where)
    d = JsonlDir(src, storage_options=opts)
    if d.exists_sync() and not src.endswith((".jsonl", ".jsonl.zst")):
        man = d.manifest()
        if man is not None:
            records, where = _spread(d, sample)
            return InputSize(man.records, "manifest", records, where)
        account = InputAccount()
        n, records = _reservoir(_counted(d, account), sample)
        return InputSize(n, "counted", records, account=account)
    f = JsonlFile(src, storage_options=opts)
    import fsspec

    fs, path = fsspec.core.url_to_fs(src, **(opts or {}))
    stored = int(fs.size(path))
    if stored <= count_limit_bytes:
        account = InputAccount()
        n, recs = _reservoir(_counted(f, account), sample)
        return InputSize(n, "counted", recs, account=account)
    head = [r for _, r in zip(range(max(sample, 5_000)), _counted(f, InputAccount()))]
    raw = b"".join(json.dumps(r).encode() + b"\n" for r in head)
    if f.compressed:
        import zstandard

        ratio = len(raw) / max(1, len(zstandard.ZstdCompressor(level=3).compress(raw)))
    else:
        ratio = 1.0
    est = int(stored * ratio / (len(raw) / max(1, len(head))))
    _, recs = _reservoir(iter(head), sample)
    return InputSize(est, f"estimated from the first {len(head):,} records and the stored size", recs,
                     f"the first {len(head):,} records (a single file too large to read whole: shard it for a spread sample)")


def as_run_records(spec: PipelineSpec, records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """``records`` as the run's tasks will see them, and what they were: an OpenAI Batch
    input's request lines converted to native records (their bodies' messages or prompt,
    their own sampling), as sharding converts them; any other input's records as they are.

    A sample of raw request lines renders no prompt (they have neither ``prompt`` nor
    ``messages`` at the top level), so a plan measured nothing without this."""
    from batch_inference.pipeline.inputs import openai_reader, resolve_format

    fmt, _ = resolve_format(spec)
    if fmt != "openai_batch":
        return records, fmt
    reader = openai_reader(spec)
    return [reader.convert(raw, i) for i, raw in enumerate(records)], fmt


def request_max_tokens(spec: PipelineSpec, records: list[dict[str, Any]]) -> list[int]:
    """Each record's own ``max_tokens`` as its request will carry it (the spec's, or the
    record's override within the spec's limits); records whose request cannot be built are left out."""
    from batch_inference.prompting import RequestBuilder

    builder = RequestBuilder(spec.request_infer)
    out = []
    for rec in records:
        try:
            out.append(int(builder.params(rec, 0).max_tokens))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def prompt_token_counts(spec: PipelineSpec, records: list[dict[str, Any]], *,
                        block_size: int | None = None) -> tuple[list[int], str, list[bytes]]:
    """Prompt tokens of each sample record, through the engine's own tokenizer, and (with a
    ``block_size``) each prompt's cacheable blocks as a prefix cache of that block size keys
    them (``engines.blocks``)."""
    from batch_inference.engines.blocks import ids_signature, text_signature
    from batch_inference.engines.chat import prompt_text
    from batch_inference.prompting import RequestBuilder

    builder = RequestBuilder(spec.request_infer)
    prompts = []
    for rec in records:
        try:
            prompts.append(builder.prompt(rec))
        except (ValueError, KeyError):
            continue  # a bad record fails at run time with its reason; it costs nothing here
    if not prompts:
        return [], "no sample record renders a prompt", []
    cfg = spec.engine
    if cfg.kind == "simulated":
        from batch_inference.engines.simulated import SIMULATED_CHARS_PER_TOKEN, LinearSimulatedEngine

        counts = LinearSimulatedEngine(cfg.simulated).count_tokens(prompts)
        blocks = [text_signature(prompt_text(p), n, block_size, SIMULATED_CHARS_PER_TOKEN) for p, n in zip(prompts, counts)] \
            if block_size else []
        return counts, "the simulated engine's tokenizer", blocks
    from transformers import AutoTokenizer

    from batch_inference.engines.chat import encode_prompts

    tok = AutoTokenizer.from_pretrained(cfg.model)
    ids = encode_prompts(tok, prompts)
    return [len(x) for x in ids], f"{cfg.model}'s tokenizer", [ids_signature(x, block_size) for x in ids] if block_size else []


PREFIX_SAMPLE = 4_000  # records read for the prefix structure, in contiguous windows
PREFIX_WINDOWS = MANIFEST_SAMPLE_SHARDS  # at most, the windows they are read in, spread over the input
PREFIX_WINDOW_RECORDS = 250  # at least, records a window holds: a family of up to about that many shows whole


def prefix_windows(spec: PipelineSpec, k: int = PREFIX_SAMPLE, *, windows: int | None = None,
                   count_limit_bytes: int = 256 << 20) -> tuple[list[dict[str, Any]], str]:
    """About ``k`` of the input's records for its prefix structure, and where they were read.

    A family of records sharing a prefix shows whole only in a contiguous run (a uniform
    sample splits it), but the input's first ``k`` records are not the input: one sorted or
    grouped by family (by task type, by source) puts unlike families at its end. So the
    records are read as ``windows`` contiguous runs of ``k / windows`` records, evenly spaced
    over the input (by default as many as keep ``PREFIX_WINDOW_RECORDS`` in each, at most
    ``PREFIX_WINDOWS``: a family longer than a window is seen cut): the heads of evenly spaced shards of a directory with a manifest (the
    cost bounded at any size, as ``_spread``), else runs at evenly spaced offsets of a
    counted input; a single file too large to count gives its first ``k`` records.
    """
    opts = spec.storage_options or None
    if windows is None:
        windows = max(1, min(PREFIX_WINDOWS, k // PREFIX_WINDOW_RECORDS))
    per = max(1, -(-k // windows))
    d = JsonlDir(spec.input, storage_options=opts)
    pq_src = _parquet(spec)
    if pq_src is not None:
        src: JsonlDir | JsonlFile | ParquetSource = pq_src
    elif d.exists_sync() and not spec.input.endswith((".jsonl", ".jsonl.zst")):
        man = d.manifest()
        if man is not None:
            shards = d.shards()
            chosen = evenly_spaced(len(shards), windows)
            per_shard = max(1, -(-k // max(1, len(chosen))))
            out: list[dict[str, Any]] = []
            for i in chosen:
                out.extend(r for _, r in zip(range(per_shard), shards[i].iter_records_sync()))
            where = (f"the heads of {len(chosen)} of {len(shards)} shards, evenly spaced" if len(chosen) < len(shards)
                     else f"the heads of all {len(shards)} shards")
            return out[:k], where
        src = d
    else:
        src = JsonlFile(spec.input, storage_options=opts)
        import fsspec

        fs, path = fsspec.core.url_to_fs(spec.input, **(opts or {}))
        if int(fs.size(path)) > count_limit_bytes:
            head = [r for _, r in zip(range(k), src.iter_records_sync())]
            return head, f"the input's first {len(head):,} records (a single file too large to count: shard it for a spread)"
    n = pq_src.rows if pq_src is not None else sum(1 for _ in src.iter_records_sync())
    if n <= k:
        return list(src.iter_records_sync()), "the whole input"
    starts = evenly_spaced(n - per + 1, windows)
    ranges = [(a, a + per) for a in starts]
    picked: list[dict[str, Any]] = []
    j = 0
    for i, rec in enumerate(src.iter_records_sync()):
        while j < len(ranges) and i >= ranges[j][1]:
            j += 1
        if j == len(ranges):
            break
        if ranges[j][0] <= i:
            picked.append(rec)
    return picked[:k], f"{len(ranges)} runs of {per:,} consecutive records, evenly spaced over its {n:,}"


@dataclass(frozen=True)
class PrefixPrediction:
    """The prefix structure of windows of the input's records (``prefix_windows``).

    ``hit_rate``: the ideal prefix-cache hit rate within the window (each distinct prefix
    block computed once: of its prompt tokens, those a perfect cache supplies); ``share``:
    of the prompt tokens, those in blocks another record of the window shares; ``family``:
    records per shared prefix, so that ``hit_rate = share x (1 - 1 / family)``. Sharing
    between records further apart than a window is seen only where a prefix recurs in
    another window (a lower bound for a shuffled input; close for one in prefix order).
    """

    share: float
    family: float
    hit_rate: float
    sample: int
    block_size: int


def predict_prefix(counts: list[int], blocks: list[bytes], block_size: int) -> PrefixPrediction | None:
    """The prefix structure of prompts (their token counts and block signatures), or None
    when no block repeats."""
    from collections import Counter

    from batch_inference.engines.blocks import BLOCK_HASH_BYTES, block_keys

    seen: Counter[bytes] = Counter()
    tails = 0
    for n, sig in zip(counts, blocks):
        seen.update(block_keys(sig))
        tails += n - len(sig) // BLOCK_HASH_BYTES * block_size
    total = sum(counts)
    shared = sum(c for c in seen.values() if c >= 2)
    if not shared or not total:
        return None
    hit_rate = 1.0 - (tails + block_size * len(seen)) / total
    share = block_size * shared / total
    family = 1.0 / (1.0 - hit_rate / share) if hit_rate < share else float(len(blocks))
    return PrefixPrediction(share=share, family=family, hit_rate=hit_rate, sample=len(blocks), block_size=block_size)
