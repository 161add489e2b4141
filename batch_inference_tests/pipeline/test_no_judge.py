"""Issue 40 item 4: the judge is optional. A spec without ``judge`` (or with ``judge: {kind: none}``)
infers each record once: a success is approved, a failure fails with its reason; no round or
attempt follows, whatever the strategy."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml
from click.testing import CliRunner

from batch_inference.cli.pipeline_cmds import run, validate
from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout, SpecError
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import spec_dict


def _judgeless(tmp_path: Path, **overrides: object) -> dict:
    """40 records, 4 of which the simulated engine fails (``fail_on``); approval 0.3 would reject most if anything judged."""
    with (tmp_path / "input.jsonl").open("wb") as f:
        for i in range(40):
            f.write(orjson.dumps({"id": f"r{i:02d}", "prompt": f"BROKEN {i}" if i % 10 == 3 else f"question {i}"}) + b"\n")
    data = spec_dict(tmp_path, approval=0.3, engine={"simulated": {"approval_rate": 0.3, "fail_on": "BROKEN"}}, **overrides)
    del data["judge"]
    return data


@pytest.mark.parametrize("strategy", ["rounds", "hybrid", "in_place"])
def test_a_spec_without_a_judge_infers_each_record_once(tmp_path: Path, strategy: str) -> None:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(_judgeless(tmp_path, strategy=strategy, max_rounds=3, max_attempts=5)))
    checked = CliRunner().invoke(validate, [str(spec_path)])
    assert checked.exit_code == 0 and "judge      none (one inference per record; every success approved)" in checked.output
    result = CliRunner().invoke(run, [str(spec_path)], terminal_width=160)
    assert result.exit_code == 5, result.output  # records_failed: only the four broken ones
    assert "status: records_failed" in result.output and "conservation: OK" in result.output
    view = Ledger(RunLayout(str(tmp_path / "out"), "test-run")).view()
    assert (view.run.approved, view.run.failed, view.run.exhausted, view.run.max_attempts) == (36, 4, 0, 0)
    assert view.run.engine_requests == 40  # one inference per record, no judge model call, no retry
    if strategy == "in_place":
        assert view.run.tail and not view.rounds
    else:
        assert len(view.rounds) == 1 and view.rounds[0].decision.kind == "done" and not view.run.tail
        assert not (tmp_path / "out" / "test-run" / "round-01").exists()  # nothing recompacted
    errors = [r for d in ("round-00/failed-records", "tail/unfinished") if (tmp_path / "out" / "test-run" / d).is_dir()
              for r in JsonlDir(str(tmp_path / "out" / "test-run" / d)).iter_records_sync()]
    assert sorted(r["id"] for r in errors) == ["r03", "r13", "r23", "r33"]
    assert all(r["error"].startswith("simulated_error: prompt contains 'BROKEN'") for r in errors)


def test_judge_kind_none_is_a_kind_and_takes_no_judge_keys(tmp_path: Path) -> None:
    data = _judgeless(tmp_path)
    assert PipelineSpec.parse({**data, "judge": {"kind": "none"}}).judged is False
    assert PipelineSpec.parse(data).judge.kind == "none"
    with pytest.raises(SpecError, match="a judge of kind 'none' judges nothing: remove template"):
        PipelineSpec.parse({**data, "judge": {"kind": "none", "template": "{result}"}})
