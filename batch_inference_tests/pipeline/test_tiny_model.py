"""Once, on the real tiny model (transformers on CPU): a rounds run end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import spec_dict


@pytest.mark.slow
async def test_rounds_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = PipelineSpec.parse(spec_dict(
        tmp_path, records=24, shard_records=8, chunk_size=8, max_rounds=2,
        engine={"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu", "num_threads": 1},
        infer={"template": "Q: {prompt}\nA:", "sampling": {"max_tokens": 6, "min_tokens": 6, "seed": 3}},
        judge={"kind": "rule", "callable": "min_length", "kwargs": {"min_chars": 12}},
        pool={"concurrency": 3, "batcher": {"batch_timeout_s": 0.01}},
    ))
    summary = await run_pipeline(spec)
    assert summary.conservation["ok"]
    assert summary.approved + summary.exhausted == 24 and summary.failed == 0
    assert summary.tokens_in > 0 and summary.tokens_out >= 24 * 6
    results = list(JsonlDir(summary.results_url).iter_records_sync()) if summary.approved else []
    assert all(isinstance(r["result"], str) and len(r["result"]) >= 12 for r in results)
