"""Fixtures for the Dagster layer: spec files, definitions and an ephemeral instance."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import orjson
import pytest
import yaml

from batch_inference.definitions import build_definitions
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.storage.resources import StorageResource


def write_input(path: Path, n: int, prefix: str = "r") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"id": f"{prefix}{i:04d}", "prompt": f"say something about {i}"}) + b"\n")
    return path


def simulated_spec(run: str, input_path: Path, output: Path, **overrides: Any) -> dict[str, Any]:
    """A fast spec: the simulated engine approves ~``approval`` of the samples."""
    approval = overrides.pop("approval", 0.5)
    spec: dict[str, Any] = {
        "run": run,
        "input": str(input_path),
        "output": str(output),
        "engine": {"kind": "simulated", "simulated": {"latency_a_s": 0.0, "latency_b_s": 0.0, "approval_rate": approval}},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": 3}},
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}},
        "strategy": "rounds",
        "max_rounds": 3,
        "max_attempts": 5,
        "shard_records": 20,
        "chunk_size": 10,
        "pool": {"launcher": "inprocess", "concurrency": 4},
    }
    spec.update(overrides)
    return spec


@pytest.fixture
def write_spec(tmp_path: Path) -> Callable[..., Path]:
    """``write_spec(run, records=60, **overrides) -> spec path`` (input and output under tmp)."""

    def make(run: str, records: int = 60, **overrides: Any) -> Path:
        data = write_input(tmp_path / "inputs" / f"{run}.jsonl", records, prefix=f"{run}-")
        spec = simulated_spec(run, data, tmp_path / "runs", **overrides)
        path = tmp_path / "specs" / f"{run}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(spec))
        return path

    return make


@pytest.fixture
def defs() -> dg.Definitions:
    return build_definitions(pool=PoolResource(mode="inprocess"), storage=StorageResource())


@pytest.fixture
def instance() -> dg.DagsterInstance:
    return dg.DagsterInstance.ephemeral()
