"""Helpers for the pipeline tests: a small JSONL input and a spec on the simulated engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import PipelineSpec


def write_input(path: Path, n: int, *, with_ids: bool = False) -> Path:
    with open(path, "wb") as f:
        for i in range(n):
            rec: dict[str, Any] = {"prompt": f"question number {i}"}
            if with_ids:
                rec["id"] = f"q{i}"
            f.write(orjson.dumps(rec) + b"\n")
    return path


def spec_dict(tmp_path: Path, *, records: int = 600, approval: float = 0.5, **overrides: Any) -> dict[str, Any]:
    """A fast spec: simulated engine (0.2 ms per call), 100-record shards, 4 task slots."""
    src = tmp_path / "input.jsonl"
    if not src.exists():
        write_input(src, records)
    data: dict[str, Any] = {
        "run": "test-run",
        "input": str(src),
        "output": str(tmp_path / "out"),
        "engine": {"kind": "simulated", "simulated": {"approval_rate": approval, "latency_a_s": 0.0002, "latency_b_s": 0.0}},
        "infer": {"template": "Answer: {prompt}", "sampling": {"max_tokens": 8, "seed": 7}},
        "judge": {"kind": "llm", "template": "Judge this answer: {result}"},
        "strategy": "rounds",
        "max_rounds": 3,
        "max_attempts": 5,
        "shard_records": 100,
        "chunk_size": 50,
        "pool": {"concurrency": 4, "retries": 1, "batcher": {"batch_timeout_s": 0.002}},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


@pytest.fixture
def make_spec(tmp_path: Path):
    def make(**overrides: Any) -> PipelineSpec:
        return PipelineSpec.parse(spec_dict(tmp_path, **overrides))

    return make
