"""A record format is one registration (``pipeline.record_formats``): its first record picks
it under ``input_format: auto``, and sharding and the preflight convert its records."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import PipelineRun, PipelineSpec
from batch_inference.pipeline.inputs import resolve_format
from batch_inference.pipeline.preflight import preflight
from batch_inference.pipeline.record_formats import RecordFormat, register_record_format, unregister_record_format
from batch_inference.storage import JsonlDir

from .helpers import spec_dict


class Unwrap:
    """An envelope line ``{"envelope": {...record...}, "meta": ...}``: the record inside."""

    def convert(self, raw: dict[str, Any], pos: int) -> dict[str, Any]:
        return dict(raw["envelope"])


@pytest.fixture
def envelope() -> Iterator[RecordFormat]:
    yield register_record_format(RecordFormat("envelope", looks_like=lambda rec: isinstance(rec, dict) and "envelope" in rec,
                                              reader=lambda spec: Unwrap()))
    unregister_record_format("envelope")


def _spec(tmp_path: Path) -> PipelineSpec:
    src = tmp_path / "wrapped.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"envelope": {"id": f"r{i}", "prompt": f"q{i}"}, "meta": i}) + b"\n" for i in range(5)))
    return PipelineSpec.parse(spec_dict(tmp_path, input=str(src), input_format="auto"))


async def test_a_registered_record_format_is_detected_and_converted_at_sharding(tmp_path: Path, envelope: RecordFormat) -> None:
    spec = _spec(tmp_path)
    assert resolve_format(spec) == ("envelope", True)
    plan = preflight(spec)  # the sample converted: its prompts render, no field is missing
    assert plan.input_format == "envelope" and plan.checked_records == 5 and not plan.record_errors
    run = PipelineRun(spec)
    await run.shard()
    rows = sorted(JsonlDir(run.layout.sharded).iter_records_sync(), key=lambda r: r["id"])
    assert [(r["id"], r["prompt"]) for r in rows] == [(f"r{i}", f"q{i}") for i in range(5)]
    assert all("envelope" not in r and "meta" not in r for r in rows)


def test_without_it_the_records_are_native(tmp_path: Path) -> None:
    assert resolve_format(_spec(tmp_path)) == ("jsonl", False)
