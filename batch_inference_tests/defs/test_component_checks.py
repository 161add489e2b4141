"""Issue 40 item 5: a component's spec is checked when its definitions load (``dg check defs``), with
``validate``'s message: a misspelt key, or a template placeholder the input's records lack, fails the
load instead of the nightly run. Loading stays cheap: no model, at most ``preflight_records`` records."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import orjson
import pytest
from dagster.components.testing import create_defs_folder_sandbox

from batch_inference import BatchInferenceComponent
from batch_inference_tests.defs.helpers import simulated_spec


def _load(spec: dict, **attributes: object) -> dg.Definitions:
    with create_defs_folder_sandbox() as sandbox:
        sandbox.scaffold_component(component_cls=BatchInferenceComponent, defs_path="scoring", defs_yaml_contents={
            "type": "batch_inference.BatchInferenceComponent", "attributes": {"spec": spec, **attributes}})
        with sandbox.build_all_defs() as defs:
            dg.Definitions.validate_loadable(defs)
            return defs


def _message(exc: BaseException) -> str:
    """The whole chain's text: Dagster wraps a component's error in its own."""
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return "\n".join(parts)


def _reviews(path: Path) -> Path:
    with path.open("wb") as f:
        for i in range(50):
            f.write(orjson.dumps({"id": f"r{i}", "review": f"great product {i}"}) + b"\n")
    return path


def test_a_misspelt_key_fails_the_load_with_validates_message(tmp_path: Path) -> None:
    spec = simulated_spec("unused", tmp_path / "none.jsonl", tmp_path / "out")
    del spec["run"], spec["input"], spec["max_rounds"]
    with pytest.raises(Exception) as caught:
        _load({**spec, "max_round": 1}, deps=["raw_prompts"])
    text = _message(caught.value)
    assert "scoring/defs.yaml: the pipeline's spec cannot run" in text
    assert "max_round: unknown key (did you mean `max_rounds`?)" in text


def test_a_placeholder_the_inputs_records_lack_fails_the_load(tmp_path: Path) -> None:
    spec = simulated_spec("unused", _reviews(tmp_path / "reviews.jsonl"), tmp_path / "out")
    del spec["run"]
    spec["infer"] = {**spec["infer"], "template": "Classify: {review_text}"}
    with pytest.raises(Exception) as caught:
        _load(spec)
    text = _message(caught.value)
    assert "infer.template: missing_field: template field {review_text} not found in record 'r0'" in text
    spec["infer"]["template"] = "Classify: {review}"  # the field the data has: loads
    assert _load(spec).resolve_all_asset_keys()


def test_an_input_that_is_not_there_yet_is_left_to_the_run(tmp_path: Path) -> None:
    """A nightly drop absent at load time (or an upstream's, named per run) is not a load error."""
    spec = simulated_spec("unused", tmp_path / "drops" / "tonight.jsonl", tmp_path / "out")
    del spec["run"]
    assert _load(spec).resolve_all_asset_keys()
