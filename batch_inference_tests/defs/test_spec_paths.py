"""Dagster: a spec's relative paths resolve from the spec file's folder, not the code server's
working directory, and a spec error is the start step's own failure message."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
import yaml

from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.keys import RESULTS
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference_tests.defs.helpers import history, latest, simulated_spec
from batch_inference_tests.pipeline.helpers import write_input


def test_a_spec_with_relative_paths_runs_from_another_working_directory(defs, instance, tmp_path: Path, tiny_model_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "models").mkdir()
    (proj / "models" / "tiny").symlink_to(tiny_model_dir)
    write_input(proj / "data" / "in.jsonl", 30)
    (proj / "spec.yaml").write_text(yaml.safe_dump(simulated_spec("rel", Path("data/in.jsonl"), Path("runs"))))
    (tmp_path / "server").mkdir()
    monkeypatch.chdir(tmp_path / "server")  # the code server's working directory
    assert start_run(defs, instance, start_run_config(str(proj / "spec.yaml"))).success
    result = drive(defs, instance)
    assert history(result)[-1] == ("results_job", "rel") and all(r.success for r in result.launched)
    assert latest(instance, RESULTS, "rel")["approved"] > 0
    assert (proj / "runs" / "rel" / "ledger" / "run.json").exists() and not (tmp_path / "server" / "runs").exists()

    # a transformers model named relative to the spec: found; a missing one: the failure says so, and only that
    model = simulated_spec("model", Path("data/in.jsonl"), Path("runs"), engine={"kind": "transformers", "model": "models/tiny"})
    (proj / "model.yaml").write_text(yaml.safe_dump(model))
    assert start_run(defs, instance, start_run_config(str(proj / "model.yaml"))).success
    model["engine"]["model"] = "models/missing"
    (proj / "missing.yaml").write_text(yaml.safe_dump(model))
    failed = defs.resolve_job_def("start_pipeline_run").execute_in_process(
        run_config=start_run_config(str(proj / "missing.yaml")), instance=instance, raise_on_error=False)
    error = failed.get_step_failure_events()[0].step_failure_data.error
    assert error is not None and error.cause is None
    assert error.message.startswith(f"dagster._core.definitions.events.Failure: spec {proj / 'missing.yaml'} cannot run: ")
    assert f"engine.model: model directory '{proj / 'models' / 'missing'}' does not exist" in error.message
    assert sorted(instance.get_dynamic_partitions("pipeline_runs")) == ["model", "rel"]  # the failed start added none
