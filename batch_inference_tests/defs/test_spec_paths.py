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


def test_a_step_that_resumes_under_another_spec_fails_with_the_spec_error_itself(defs, tmp_path: Path) -> None:
    write_input(tmp_path / "in.jsonl", 20)
    first = dg.DagsterInstance.ephemeral()
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(simulated_spec("same", tmp_path / "in.jsonl", tmp_path / "runs")))
    assert start_run(defs, first, start_run_config(str(tmp_path / "a.yaml"))).success
    assert all(r.success for r in drive(defs, first).launched)
    # another Dagster instance starts a run of the same name into the same folder, with another template
    edited = simulated_spec("same", tmp_path / "in.jsonl", tmp_path / "runs", infer={"template": "Say: {prompt}"})
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(edited))
    second = dg.DagsterInstance.ephemeral()
    assert start_run(defs, second, start_run_config(str(tmp_path / "b.yaml"))).success
    failed = [r for r in drive(defs, second, max_ticks=3).launched if not r.success]
    assert failed
    events = second.all_logs(failed[0].run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
    error = events[0].dagster_event.step_failure_data.error
    assert error.cause is None and error.message.startswith(
        "dagster._core.definitions.events.Failure: pipeline run 'same': SpecChanged: run 'same' started under another spec: "
        ), error.message
    assert "infer.template" in error.message.split(" changed since ")[0]
