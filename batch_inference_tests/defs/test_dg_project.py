"""The ``dg`` CLI: this repository is a dg project whose definitions load (``dg check defs``, what CI
runs through ``make test-unit``), and ``dg scaffold defs batch_inference.BatchInferenceComponent
scoring`` in a user's project writes a ``defs.yaml`` that ``dg check defs`` accepts and that
yields the pipeline's assets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from batch_inference_tests.defs.dagster_dev import ROOT, write_entry_points

pytestmark = [pytest.mark.slow, pytest.mark.process]
BIN = Path(sys.executable).parent
DG = str(BIN / "dg")


def _env(tmp_path: Path, *paths: Path) -> dict[str, str]:
    site = write_entry_points(tmp_path / "site")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [site, *paths, ROOT])), "DAGSTER_DISABLE_TELEMETRY": "1",
            "VIRTUAL_ENV": str(BIN.parent), "DAGSTER_HOME": str(tmp_path)}


def _dg(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([DG, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"dg {' '.join(args)}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def test_dg_check_defs_on_this_project(tmp_path: Path) -> None:
    done = _dg(["check", "defs"], ROOT, _env(tmp_path))
    assert "All definitions loaded successfully" in done.stdout + done.stderr


def _user_project(tmp_path: Path) -> tuple[Path, Path]:
    """A user's dg project (``create-dagster project``'s layout): its root and its package."""
    root = tmp_path / "proj"
    pkg = root / "src" / "user_proj"
    (pkg / "defs").mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent('''
        [project]
        name = "user_proj"
        version = "0.0.1"

        [tool.dg]
        directory_type = "project"

        [tool.dg.project]
        root_module = "user_proj"
    '''))
    (pkg / "__init__.py").write_text("")
    (pkg / "defs" / "__init__.py").write_text("")
    (pkg / "definitions.py").write_text(textwrap.dedent('''
        from pathlib import Path

        import dagster as dg


        @dg.definitions
        def defs() -> dg.Definitions:
            return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
    '''))
    return root, pkg


def test_dg_scaffold_writes_a_working_defs_yaml(tmp_path: Path) -> None:
    root, pkg = _user_project(tmp_path)
    env = _env(tmp_path, root / "src")
    listed = _dg(["list", "components", "--json"], root, env)
    assert "batch_inference.BatchInferenceComponent" in {c["key"] for c in json.loads(listed.stdout)["items"]}
    _dg(["scaffold", "defs", "batch_inference.BatchInferenceComponent", "scoring"], root, env)
    written = yaml.safe_load((pkg / "defs" / "scoring" / "defs.yaml").read_text())
    assert written["type"] == "batch_inference.BatchInferenceComponent"
    assert written["attributes"]["schedule"]["run_name"] == "scoring-{date}"
    _dg(["check", "defs"], root, env)
    assets = {a.get("asset_key", a.get("key")) for a in json.loads(_dg(["list", "defs", "--json"], root, env).stdout)["assets"]}
    assert {"scoring/source_dataset", "scoring/sharded", "scoring/results"} <= assets


def test_dg_check_defs_fails_on_a_misspelt_spec_key(tmp_path: Path) -> None:
    """Issue 40 item 5: the component checks its spec at load, so `dg check defs` names the key."""
    root, pkg = _user_project(tmp_path)
    env = _env(tmp_path, root / "src")
    _dg(["scaffold", "defs", "batch_inference.BatchInferenceComponent", "scoring"], root, env)
    path = pkg / "defs" / "scoring" / "defs.yaml"
    body = yaml.safe_load(path.read_text())
    body["attributes"]["spec"]["max_round"] = body["attributes"]["spec"].pop("max_rounds")
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    done = subprocess.run([DG, "check", "defs"], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "max_round: unknown key (did you mean `max_rounds`?)" in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
