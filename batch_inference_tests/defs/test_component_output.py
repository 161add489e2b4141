"""Issue 40 item 9: the scaffolded ``defs.yaml`` sets no ``output`` (its ``out`` resolved inside the
project's source tree, ``src/<pkg>/defs/<name>/out``); a run of a spec without one writes under the
Dagster instance's storage, ``<storage>/batch_inference/<prefix>/<run>``."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import orjson
import yaml
from dagster.components.testing import create_defs_folder_sandbox

from batch_inference import BatchInferenceComponent
from batch_inference.defs.driver import drive
from batch_inference.defs.keys import PipelineKeys
from batch_inference.defs.runs.jobs import start_run_config


def test_a_scaffolded_pipeline_writes_under_the_instances_storage_not_the_source_tree() -> None:
    with create_defs_folder_sandbox() as sandbox:
        folder = sandbox.scaffold_component(component_cls=BatchInferenceComponent, defs_path="scoring")
        body = yaml.safe_load((folder / "defs.yaml").read_text())
        assert "output" not in body["attributes"]["spec"]
        with (folder / "prompts.jsonl").open("wb") as f:  # the scaffold's input, beside its defs.yaml
            for i in range(30):
                f.write(orjson.dumps({"id": f"p{i}", "prompt": f"say something about {i}"}) + b"\n")
        with sandbox.build_all_defs() as defs:
            instance = dg.DagsterInstance.ephemeral()
            keys = PipelineKeys(("scoring",))
            started = defs.resolve_job_def(keys.name("start_pipeline_run")).execute_in_process(
                run_config=start_run_config(None, run="scoring-1", k=keys), instance=instance)
            assert started.success
            result = drive(defs, instance, sensor_name="scoring__round_sensor", log_level="WARNING")
            assert result.launched and all(r.success for r in result.launched)
            run_root = Path(instance.storage_directory()) / "batch_inference" / "scoring" / "scoring-1"
            assert (run_root / "ledger" / "run.json").is_file()
            assert not any(p.name == "out" for p in Path(folder).iterdir())  # nothing written in the source tree
