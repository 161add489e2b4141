"""Helpers for the Dagster-layer tests: inputs and specs on the simulated engine, and what an
instance recorded (launched steps, an asset's latest metadata, check results)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import orjson


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


def history(result) -> list[tuple[str, str]]:
    return [(r.job_name, r.partition_key) for r in result.launched]


def latest(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str) -> dict:
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1).records
    assert recs, f"no materialization of {key.to_user_string()}[{partition}]"
    return {k: v.value for k, v in recs[0].asset_materialization.metadata.items()}


def check_results(instance: dg.DagsterInstance, asset: dg.AssetKey) -> dict[str, bool]:
    """check name -> passed, for the latest evaluation of each check on ``asset``."""
    out = {}
    for record in instance.event_log_storage.get_event_records(
        dg.EventRecordsFilter(event_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION), limit=1000, ascending=True
    ):
        evaluation = record.event_log_entry.dagster_event.event_specific_data
        if evaluation.asset_key == asset:
            out[evaluation.check_name] = evaluation.passed
    return out
