"""What a spec's input and prompts look like, before it runs: record count and prompt tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.storage import JsonlDir, JsonlFile


@dataclass(frozen=True)
class InputSize:
    records: int
    how: str  # "manifest" | "counted" | "estimated from N records"
    sample: list[dict[str, Any]]


def input_size(spec: PipelineSpec, *, sample: int = 500, count_limit_bytes: int = 256 << 20) -> InputSize:
    """The input's record count (manifest, count, or estimate) and its first ``sample`` records."""
    opts = spec.storage_options or None
    src = spec.input
    d = JsonlDir(src, storage_options=opts)
    if d.exists_sync() and not src.endswith((".jsonl", ".jsonl.zst")):
        man = d.manifest()
        records = [r for _, r in zip(range(sample), d.iter_records_sync())]
        if man is not None:
            return InputSize(man.records, "manifest", records)
        return InputSize(d.count_records(), "counted", records)
    f = JsonlFile(src, storage_options=opts)
    import fsspec

    fs, path = fsspec.core.url_to_fs(src, **(opts or {}))
    stored = int(fs.size(path))
    if stored <= count_limit_bytes:
        recs: list[dict[str, Any]] = []
        n = 0
        for rec in f.iter_records_sync():
            if n < sample:
                recs.append(rec)
            n += 1
        return InputSize(n, "counted", recs)
    head = [r for _, r in zip(range(max(sample, 5_000)), f.iter_records_sync())]
    raw = b"".join(json.dumps(r).encode() + b"\n" for r in head)
    if f.compressed:
        import zstandard

        ratio = len(raw) / max(1, len(zstandard.ZstdCompressor(level=3).compress(raw)))
    else:
        ratio = 1.0
    est = int(stored * ratio / (len(raw) / max(1, len(head))))
    return InputSize(est, f"estimated from the first {len(head):,} records and the stored size", head[:sample])


def prompt_token_counts(spec: PipelineSpec, records: list[dict[str, Any]]) -> tuple[list[int], str]:
    """Prompt tokens of each sample record, through the engine's own tokenizer."""
    from batch_inference.prompting import RequestBuilder

    builder = RequestBuilder(spec.infer)
    prompts = []
    for rec in records:
        try:
            prompts.append(builder.prompt(rec))
        except (ValueError, KeyError):
            continue  # a bad record fails at run time with its reason; it costs nothing here
    if not prompts:
        return [], "no sample record renders a prompt"
    cfg = spec.engine
    if cfg.kind == "simulated":
        from batch_inference.engines.simulated import LinearSimulatedEngine

        return LinearSimulatedEngine(cfg.simulated).count_tokens(prompts), "the simulated engine's tokenizer"
    from transformers import AutoTokenizer

    from batch_inference.engines.chat import encode_prompts

    tok = AutoTokenizer.from_pretrained(cfg.model)
    return [len(ids) for ids in encode_prompts(tok, prompts)], f"{cfg.model}'s tokenizer"
