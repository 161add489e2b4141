"""The honest figures in the ledger and the CLI table: output tokens/s and the engine's
own occupancy next to the reference's utilization and fill."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rich.console import Console

from batch_inference.pipeline import Ledger, RunLayout, run_pipeline
from batch_inference.pipeline.report import ledger_table

STREAMING = {"kind": "simulated", "simulated": {"cost_model": "decode", "scheduling": "continuous",
                                                "approval_rate": 1.0, "output_tokens": 16}}


@pytest.mark.slow  # 3,000 records of simulated decoding, which sleeps in real time
async def test_a_streamed_round_records_output_tokens_per_s_and_engine_occupancy(make_spec, tmp_path: Path) -> None:
    spec = make_spec(engine=STREAMING, max_rounds=1, records=3000, shard_records=500, chunk_size=500,
                     infer={"sampling": {"max_tokens": 64, "seed": 7}})
    started = time.monotonic()
    summary = await run_pipeline(spec)
    elapsed = time.monotonic() - started
    view = Ledger(RunLayout(spec.output, spec.run)).view()
    infer = view.rounds[0].infer
    assert summary.approved == 3000 and infer.tokens_out == 3000 * 16  # fixed lengths: 16 tokens a record
    # per second of the phase, which lasts at least its longest task and at most the whole run
    assert infer.tokens_out / elapsed <= infer.output_tokens_per_s <= infer.tokens_out / infer.longest_task_s
    assert view.rounds[0].output_tokens_per_s == infer.output_tokens_per_s
    engine = infer.engine
    assert engine["mode"] == "stream" and engine["samples"] >= 1 and engine["capacity"] > 0
    assert engine["mean_in_flight"] > 0 and "mean_kv_cache_usage" in engine and "mean_engine_running" in engine
    console = Console(width=200, record=True)
    console.print(ledger_table(view, "t"))
    text = console.export_text()
    assert "out tok/s" in text and f"{infer.output_tokens_per_s:,.0f}" in text


async def test_a_batched_round_records_its_mode_and_rate(make_spec) -> None:
    spec = make_spec(max_rounds=1, records=200)
    await run_pipeline(spec)
    infer = Ledger(RunLayout(spec.output, spec.run)).view().rounds[0].infer
    assert infer.output_tokens_per_s > 0
    assert infer.engine in ({}, {"mode": "batch", "samples": infer.engine.get("samples")})
