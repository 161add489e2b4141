"""Dagster: an OpenAI Batch input runs to the openai_batch_export asset; a bad spec fails the start job."""

from __future__ import annotations

import json

import dagster as dg
import orjson
import pytest
import yaml

from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.keys import OPENAI_EXPORT, RESULTS
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference_tests.defs.helpers import history, latest, simulated_spec


def test_openai_batch_run_ends_in_the_export_asset(defs, instance, tmp_path) -> None:
    src = tmp_path / "batch.jsonl"
    src.write_bytes(b"".join(orjson.dumps({
        "custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 8},
    }) + b"\n" for i in range(30)))
    spec = simulated_spec("oai", src, tmp_path / "runs", max_rounds=2, openai_batch={"model": "sim"})
    spec["infer"] = {"sampling": {"max_tokens": 8, "seed": 3}}
    spec_path = tmp_path / "oai.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    result = drive(defs, instance)
    assert history(result)[-1] == ("results_job", "oai") and all(r.success for r in result.launched)
    assert latest(instance, dg.AssetKey("sharded"), "oai")["input_format"] == "openai_batch"
    meta = latest(instance, OPENAI_EXPORT, "oai")
    res = latest(instance, RESULTS, "oai")
    assert meta["requests"] == 30 and meta["answered"] == res["approved"] and meta["failed_requests"] == 30 - res["approved"]
    with open(str(tmp_path / "runs" / "oai" / "export" / "openai_batch" / "output.jsonl")) as f:
        ids = [json.loads(line)["custom_id"] for line in f]
    with open(str(tmp_path / "runs" / "oai" / "export" / "openai_batch" / "errors.jsonl")) as f:
        ids += [json.loads(line)["custom_id"] for line in f]
    assert sorted(ids) == sorted(f"c{i}" for i in range(30))


def test_native_run_has_no_export_and_a_bad_spec_fails_the_start_job(defs, instance, write_spec) -> None:
    assert start_run(defs, instance, start_run_config(str(write_spec("native", records=20)))).success
    drive(defs, instance)
    assert not instance.fetch_materializations(OPENAI_EXPORT, limit=1).records
    bad = write_spec("bad", records=20, judge={"kind": "rule", "callable": "min_length", "kwargs": {"n": 0}})
    with pytest.raises(dg.Failure, match="cannot run: judge.kwargs: rule 'min_length' does not accept kwargs"):
        start_run(defs, instance, start_run_config(str(bad)))
    assert "bad" not in instance.get_dynamic_partitions("pipeline_runs")
