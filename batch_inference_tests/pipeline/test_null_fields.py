"""Issue 40 item 3: a null template field is no value. It fails its record alone (``missing_field``,
as a missing key does) unless ``infer.null_fields: empty`` says it renders as ``""``; never the
string "None". ``validate`` counts the records that would fail, and warns about empty strings."""

from __future__ import annotations

from pathlib import Path

import orjson
import yaml
from click.testing import CliRunner

from batch_inference.cli.pipeline_cmds import validate
from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import spec_dict

NULL_IDS = {"r03", "r07", "r11", "r15", "r19"}


def _write(path: Path) -> None:
    """20 records: 5 with a null ``text``, one without it, two with an empty string."""
    with path.open("wb") as f:
        for i in range(20):
            rid = f"r{i:02d}"
            text = None if rid in NULL_IDS else "" if i in (4, 9) else f"review number {i}"
            rec = {"id": rid, "text": text} if i != 12 else {"id": rid}
            f.write(orjson.dumps(rec) + b"\n")


def _spec(tmp_path: Path, **infer: object) -> dict:
    _write(tmp_path / "input.jsonl")
    return spec_dict(tmp_path, approval=1.0, infer={"template": "Review: {text}", **infer}, max_rounds=1)


def _rows(url: Path) -> dict[str, dict]:
    return {r["id"]: r for r in JsonlDir(str(url)).iter_records_sync()} if url.is_dir() else {}


async def test_null_fields_fail_their_record_and_empty_strings_run(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(_spec(tmp_path))
    summary = await run_pipeline(spec)
    run = tmp_path / "out" / "test-run"
    approved = _rows(run / "results")
    failed = _rows(run / "round-00" / "failed-records")
    assert set(failed) == NULL_IDS | {"r12"} and summary.failed == 6 and summary.approved == 14
    assert all("None" not in str(r.get("result")) for r in approved.values())
    for rid in NULL_IDS:
        assert failed[rid]["error"] == (f"missing_field: template field {{text}} is null in record {rid!r} "
                                        "(null_fields: empty renders a null as '')")
    assert failed["r12"]["error"].startswith("missing_field: template field {text} not found")
    assert {"r04", "r09"} <= set(approved)  # an empty string is legal


async def test_null_fields_empty_renders_them_as_empty_strings(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(_spec(tmp_path, null_fields="empty"))
    summary = await run_pipeline(spec)
    assert (summary.approved, summary.failed) == (19, 1)  # only the record without the key fails


def test_validate_counts_null_missing_and_empty_fields(tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(_spec(tmp_path)))
    result = CliRunner().invoke(validate, [str(spec_path)])
    assert result.exit_code == 0, result.output
    assert "infer.template: 6 of 20 record(s) read would fail missing_field: " in result.output
    assert "{text} null in 5 (e.g. 'r03', 'r07', 'r11')" in result.output and "{text} missing in 1 (e.g. 'r12')" in result.output
    assert "infer.template: {text} is an empty string in 2 of 20 record(s) read (e.g. 'r04', 'r09')" in result.output
    quick = CliRunner().invoke(validate, [str(spec_path), "--quick"])  # the sample (preflight_records) only
    assert quick.exit_code == 0 and "of 8 record(s) read would fail missing_field" in quick.output
