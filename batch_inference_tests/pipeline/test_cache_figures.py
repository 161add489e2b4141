"""The figures of what the engine did not compute, per phase: prefix-cache hits, prefill
against the ideal (each distinct prefix once), duplicates saved; in the ledger, the CLI
table and the worker's /stats (the Dagster metadata: defs/test_units.py)."""

from __future__ import annotations

from pathlib import Path

import orjson
from rich.console import Console

from batch_inference.engines.blocks import DistinctBlocks, cacheable_blocks
from batch_inference.engines.simulated import simulated_encode
from batch_inference.pipeline import PipelineRun, PipelineSpec, run_pipeline
from batch_inference.pipeline.report import ledger_table
from batch_inference.pipeline.runner import open_runner
from batch_inference_tests.pipeline.helpers import spec_dict

DOCS, QUESTIONS = 6, 12


def _documents_x_questions(path: Path) -> list[str]:
    """Each document asked several questions (two asked twice: exact repeats), interleaved."""
    prompts = []
    with open(path, "wb") as f:
        for q in range(QUESTIONS):
            for d in range(DOCS):
                text = f"document {d}: " + f"fact {d} is worth knowing. " * 30 + f"question {min(q, QUESTIONS - 3)}?"
                prompts.append(text)
                f.write(orjson.dumps({"prompt": text}) + b"\n")
    return prompts


def _ideal(prompts: list[str], template: str, block_size: int) -> int:
    """Each distinct prompt's tokens past its cacheable blocks, plus every distinct block once."""
    blocks = DistinctBlocks(exact_limit=1 << 20)
    tail = 0
    from batch_inference.engines import build_engine

    engine = build_engine({"kind": "simulated", "simulated": {"cost_model": "decode", "prefix_cache": True,
                                                               "decode": {"block_size": block_size}}})
    for p in sorted(set(prompts)):
        tokens = simulated_encode(template.format(prompt=p))
        blocks.add(engine.prefix_signature(tokens))
        tail += len(tokens.ids) - cacheable_blocks(len(tokens.ids), block_size) * block_size
    return blocks.estimate() * block_size + tail


def _spec(tmp_path: Path, **engine: object) -> PipelineSpec:
    data = spec_dict(tmp_path, max_rounds=1, shard_records=24, chunk_size=12,
                     engine={"simulated": {"cost_model": "decode", "scheduling": "continuous", "greedy": "prompt",
                                           "profile": "h200-llama-8b", "decode": {"step_s": 1e-5}, **engine}})
    data["infer"]["sampling"] = {"max_tokens": 6, "temperature": 0.0}
    return PipelineSpec.parse(data)


async def test_a_phase_records_its_prefix_cache_and_ideal_and_every_view_shows_them(tmp_path: Path) -> None:
    prompts = _documents_x_questions(tmp_path / "input.jsonl")
    spec = _spec(tmp_path, prefix_cache=True)
    await run_pipeline(spec)
    view = PipelineRun(spec).ledger.view()
    infer = view.rounds[0].infer
    assert infer is not None and infer.records_in == DOCS * QUESTIONS
    assert infer.duplicates == DOCS * 2  # the two questions asked again, once per document
    assert infer.prefix_queried == infer.tokens_in - infer.duplicate_tokens_in  # the requests the engine ran
    assert infer.prefix_hit_rate is not None and infer.prefix_hit_rate > 0.5
    # the ideal over every shard's (and any worker's) requests, merged: exact at this size
    assert infer.ideal_prefill_tokens == _ideal(prompts, spec.infer.template or "", 16)
    assert 1.0 <= infer.prefill_vs_ideal < 1.6  # interleaved input: some prefixes computed again
    # the CLI table, the Dagster metadata
    console = Console(width=250, record=True)
    console.print(ledger_table(view, "t"))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "phase" in line)
    assert " cache " in header and " vs ideal " in header and " dups " in header
    round0 = next(line for line in text.splitlines() if line.startswith("│ round 0 "))
    assert f"{view.rounds[0].prefix_hit_rate:.0%}" in round0 and f"{view.rounds[0].prefill_vs_ideal:.2f}x" in round0


async def test_the_workers_stats_carry_the_engines_prefix_cache(tmp_path: Path) -> None:
    _documents_x_questions(tmp_path / "input.jsonl")
    spec = _spec(tmp_path, prefix_cache=True)
    async with open_runner(spec) as runner:
        await run_pipeline(spec, runner=runner)
        stats = await runner.stats()
    cache = stats["prefix_cache"]
    assert cache["source"] == "engine" and cache["hits"] > 0 and 0 < cache["hit_rate"] <= 1
    assert stats["dedup"]["led"] > 0 and stats["dedup"]["joined"] + stats["dedup"]["replayed"] > 0


async def test_no_prefix_cache_no_cache_figures(tmp_path: Path) -> None:
    _documents_x_questions(tmp_path / "input.jsonl")
    spec = _spec(tmp_path)
    await run_pipeline(spec)
    infer = PipelineRun(spec).ledger.view().rounds[0].infer
    assert infer is not None and infer.prefix_hit_rate is None and infer.ideal_prefill_tokens is None
    console = Console(width=250, record=True)
    console.print(ledger_table(PipelineRun(spec).ledger.view(), "t"))
    header = next(line for line in console.export_text().splitlines() if "phase" in line)
    assert " cache " not in header and " vs ideal " not in header and " dups " in header
