"""Fixtures for the Dagster layer: spec files, definitions and an ephemeral instance."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from batch_inference.definitions import build_definitions
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.storage.resources import StorageResource
from batch_inference_tests.defs.helpers import simulated_spec, write_input


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
