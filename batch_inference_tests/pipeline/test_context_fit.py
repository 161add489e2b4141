"""Issue 40 item 7: ``validate`` catches a request that cannot fit the model (``max_tokens`` at or
over its context, read from its config without loading weights) and counts sampled prompts
that will not fit beside ``max_tokens``; ``run`` and ``status`` name why records failed."""

from __future__ import annotations

from pathlib import Path

import orjson
import yaml
from click.testing import CliRunner

from batch_inference.cli.pipeline_cmds import run, status, validate
from batch_inference_tests.pipeline.helpers import spec_dict


def test_validate_refuses_max_tokens_over_the_models_context(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = spec_dict(tmp_path, records=10, engine={"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"},
                     infer={"sampling": {"max_tokens": 4000}})
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(validate, [str(spec_path)])
    assert result.exit_code == 1, result.output
    assert (f"infer.sampling.max_tokens: 4000 >= the 2,048-token context of engine ({tiny_model_dir}'s "
            "max_position_embeddings (config.json)): no prompt fits beside it") in result.output
    data["infer"]["sampling"]["max_tokens"] = 2000  # fits beside short prompts: the run may go on
    spec_path.write_text(yaml.safe_dump(data))
    assert CliRunner().invoke(validate, [str(spec_path), "--quick"]).exit_code == 0


def test_prompts_that_will_not_fit_are_counted_and_run_and_status_name_the_reasons(tmp_path: Path) -> None:
    with (tmp_path / "input.jsonl").open("wb") as f:  # 30 records: every third is ~100 tokens, the rest ~5
        for i in range(30):
            text = "word " * 80 if i % 3 == 0 else f"question {i}"
            f.write(orjson.dumps({"id": f"r{i:02d}", "prompt": text} if i != 7 else {"id": "r07"}) + b"\n")
    data = spec_dict(tmp_path, approval=1.0, preflight_records=30, engine={"max_model_len": 64},
                     infer={"sampling": {"max_tokens": 32, "seed": 7}})
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    checked = CliRunner().invoke(validate, [str(spec_path)])
    assert checked.exit_code == 0, checked.output
    assert ("engine: 10 of 29 sampled record(s) will not fit the 64-token context (engine.max_model_len) with max_tokens: "
            "prompt tokens + max_tokens > 64 (e.g. 'r00' 102 + 32") in checked.output
    result = CliRunner().invoke(run, [str(spec_path)], terminal_width=160)
    assert result.exit_code == 5, result.output
    assert "records_failed: 11 — prompt_too_long 10, missing_field 1" in result.output
    shown = CliRunner().invoke(status, [str(tmp_path / "out" / "test-run")], terminal_width=160)
    assert "records_failed: 11 — prompt_too_long 10, missing_field 1" in shown.output
