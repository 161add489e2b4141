"""A spec's relative paths resolve from the spec file's folder, whatever the working directory
(the CLI here; Dagster in defs/test_spec_paths.py), and spec errors say what to type instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from batch_inference.cli.main import cli
from batch_inference.pipeline import PipelineSpec, RunLayout, SpecError
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import spec_dict, write_input


def project(tmp_path: Path, **overrides: Any) -> Path:
    """``proj/spec.yaml`` naming ``data/in.jsonl``, ``runs/`` and what ``overrides`` give, all relative to ``proj/``."""
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True, exist_ok=True)
    write_input(proj / "data" / "in.jsonl", 12)
    data = spec_dict(tmp_path, records=0, run="rel", input="data/in.jsonl", output="runs/", max_rounds=1,
                     judge={"kind": "rule", "callable": "min_length", "kwargs": {"min_chars": 1}}, **overrides)
    (proj / "spec.yaml").write_text(yaml.safe_dump(data))
    return proj / "spec.yaml"


def test_a_spec_files_relative_paths_resolve_from_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapters = {"adapters": {"a1": "adapters/a1", "home": "~/a2", "remote": "s3://bucket/a3"}}
    path = project(tmp_path, engine={"kind": "simulated", "simulated": {"lora": adapters}},
                   pool={"storage_roots": ["data", "/abs/root"], "storage_profiles_file": "profiles.toml"})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    spec = PipelineSpec.load(Path("..") / "proj" / "spec.yaml")
    proj = tmp_path.resolve() / "proj"
    assert (spec.input, spec.output) == (str(proj / "data/in.jsonl"), str(proj / "runs"))
    assert spec.engine.lora is not None and spec.engine.lora.adapters == {
        "a1": str(proj / "adapters/a1"), "home": str(Path("~/a2").expanduser()), "remote": "s3://bucket/a3"}
    assert spec.pool.storage_roots == [str(proj / "data"), "/abs/root"]
    assert spec.pool.storage_profiles_file == str(proj / "profiles.toml")
    # an override comes from the command line, not the file: as given
    assert PipelineSpec.load(path, input="other.jsonl").input == "other.jsonl"
    # a mapping (an API request, a component's attributes) resolves from the folder it names
    data = yaml.safe_load(path.read_text())
    assert PipelineSpec.parse(data, base_dir=proj).input == str(proj / "data/in.jsonl")
    assert PipelineSpec.parse(data).input == "data/in.jsonl"


def test_the_cli_runs_a_spec_with_a_relative_model_from_another_folder(tmp_path: Path, tiny_model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = project(tmp_path, engine={"kind": "transformers", "model": "models/tiny", "device": "cpu"},
                   infer={"template": "Q: {prompt}", "sampling": {"max_tokens": 2, "seed": 1}})
    (path.parent / "models").mkdir()
    (path.parent / "models" / "tiny").symlink_to(tiny_model_dir)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    validated = CliRunner().invoke(cli, ["validate", "../proj/spec.yaml"])
    assert validated.exit_code == 0, validated.output
    ran = CliRunner().invoke(cli, ["run", "../proj/spec.yaml"], terminal_width=300)
    assert ran.exit_code == 0, ran.output
    root = RunLayout(str(path.parent / "runs"), "rel").root
    said = ran.output.replace("\n", "")  # the console wraps long paths at its width
    assert f"-> {root}" in said and "runs//" not in said  # the spec's `output: runs/`, joined once
    assert JsonlDir(RunLayout(str(path.parent / "runs"), "rel").results).count_records() == 12
    assert not (tmp_path / "elsewhere" / "runs").exists()


def test_an_unknown_key_names_the_key_it_is_close_to(tmp_path: Path) -> None:
    data = spec_dict(tmp_path, shard_record=10, pool={"replcas": 2}, engine={"kind": "simulated", "sed": 3})
    with pytest.raises(SpecError) as err:
        PipelineSpec.parse(data)
    msg = str(err.value)
    assert "shard_record: unknown key (did you mean `shard_records`?)" in msg
    assert "pool.replcas: unknown key (did you mean `replicas`?)" in msg and "engine.sed: unknown key (did you mean `seed`?)" in msg
    with pytest.raises(SpecError, match=r"zzz_nothing_like_it: unknown key$"):
        PipelineSpec.parse(spec_dict(tmp_path, zzz_nothing_like_it=1))
