"""A user's own ``dg`` project with the component, through ``dg`` and a real ``dagster dev``.

A temporary package (``user_scoring``): an upstream asset that writes the prompts (JSONL) and
names the file in its metadata, ``defs/scoring/defs.yaml`` using
``batch_inference.BatchInferenceComponent`` with ``deps: [raw_prompts]``, and a downstream
asset reading ``scoring/results`` (rows, through the IO manager) with
``AutomationCondition.eager()``. ``dg list components`` finds the component through the
``dagster_dg_cli.registry_modules`` entry point this repository's pyproject.toml declares (its
metadata is written beside the package, as an install would); ``dg list defs`` shows the
assets. Then one ``dagster dev`` on 127.0.0.1 (stopped by process group): lineage read back
over GraphQL (upstream -> the component's assets -> downstream), and one materialisation of
the upstream leads, by the round sensor and automation alone, to results and the downstream.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from batch_inference_tests.defs.dagster_dev import LAUNCH, ROOT, default_signals, graphql, wait_for, write_entry_points
from batch_inference_tests.defs.helpers import simulated_spec
from batch_inference_tests.fixtures.infra import free_port

pytestmark = [pytest.mark.slow, pytest.mark.process]
BIN = Path(sys.executable).parent

UPSTREAM = '''
import json
from collections.abc import Iterator
from pathlib import Path

import dagster as dg

PROMPTS = Path({prompts!r})


@dg.asset
def raw_prompts() -> dg.MaterializeResult:
    """The user's prompts, written as JSONL; the path in the metadata is the pipeline's input."""
    PROMPTS.write_text("".join(json.dumps({{"id": f"p{{i}}", "prompt": f"question {{i}}"}}) + "\\n" for i in range(30)))
    return dg.MaterializeResult(metadata={{"path": dg.MetadataValue.path(str(PROMPTS))}})


@dg.asset(ins={{"results": dg.AssetIn(key=["scoring", "results"], partition_mapping=dg.LastPartitionMapping())}},
          automation_condition=dg.AutomationCondition.eager())
def scored_rows(results: Iterator) -> dg.MaterializeResult:
    rows = list(results)
    return dg.MaterializeResult(metadata={{"rows": dg.MetadataValue.int(len(rows))}})
'''


def _project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "user-project"
    pkg = root / "src" / "user_scoring"
    (pkg / "defs" / "scoring").mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent('''
        [project]
        name = "user_scoring"
        version = "0.0.1"

        [tool.dg]
        directory_type = "project"

        [tool.dg.project]
        root_module = "user_scoring"
        code_location_target_module = "user_scoring.definitions"
    '''))
    (pkg / "__init__.py").write_text("")
    (pkg / "definitions.py").write_text(textwrap.dedent('''
        from pathlib import Path

        import dagster as dg


        @dg.definitions
        def defs() -> dg.Definitions:
            return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
    '''))
    (pkg / "defs" / "__init__.py").write_text("")
    (pkg / "defs" / "user_assets.py").write_text(UPSTREAM.format(prompts=str(tmp_path / "prompts.jsonl")))
    # every record approved in round 0: start, shard, r00, results (4 sensor-driven runs, each its own
    # process per step under dagster dev: minutes on 2 busy cores; the multi-round path has its own tests)
    spec = simulated_spec("x", tmp_path / "none.jsonl", tmp_path / "out", approval=1.0)
    del spec["run"], spec["input"]
    (pkg / "defs" / "scoring" / "defs.yaml").write_text(yaml.safe_dump({
        "type": "batch_inference.BatchInferenceComponent",
        "attributes": {"spec": spec, "deps": ["raw_prompts"], "schedule": {"cron": "0 2 * * *", "run_name": "scoring-{date}"}},
    }, sort_keys=False))
    meta = write_entry_points(tmp_path / "site")
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(meta), str(root / "src"), str(ROOT)]), "DAGSTER_HOME": str(home),
           "BATCH_INFERENCE_POOL_MODE": "inprocess", "DAGSTER_DISABLE_TELEMETRY": "1"}
    return root, env


ASSETS = "{ assetNodes { assetKey { path } dependencyKeys { path } } }"
LATEST = """
query($key: AssetKeyInput!) {
  assetOrError(assetKey: $key) { ... on Asset { assetMaterializations(limit: 1) { partition metadataEntries {
    label ... on IntMetadataEntry { intValue } } } } }
}"""


@pytest.mark.timeout(900)
def test_user_project_lineage_and_automation_through_dagster_dev(tmp_path: Path) -> None:
    root, env = _project(tmp_path)
    dg_cli = str(BIN / "dg")
    listed = subprocess.run([dg_cli, "list", "components", "--json"], cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert listed.returncode == 0, listed.stderr
    assert "batch_inference.BatchInferenceComponent" in {c["key"] for c in json.loads(listed.stdout)["items"]}, listed.stdout[:2000]
    assert "missing_dg_plugin_module_in_manifest" not in listed.stderr
    defs = subprocess.run([dg_cli, "list", "defs", "--json"], cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert defs.returncode == 0, defs.stderr
    keys = {a.get("asset_key", a.get("key")) for a in json.loads(defs.stdout)["assets"]}
    assert {"raw_prompts", "scored_rows", "scoring/source_dataset", "scoring/sharded", "scoring/pending", "scoring/inferred",
            "scoring/approved", "scoring/rejected", "scoring/tail_retry", "scoring/results"} <= keys, keys

    port = free_port()
    log = (tmp_path / "dagster-dev.log").open("wb")
    proc = subprocess.Popen([str(BIN / "dagster"), "dev", "-h", "127.0.0.1", "-p", str(port), "-m", "user_scoring.definitions"],
                            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_signals,
                            start_new_session=True)
    try:
        wait_for(lambda: graphql(port, "{ version }", timeout=5).get("version"), 150, "the webserver", proc)
        nodes = graphql(port, ASSETS)["assetNodes"]
        deps = {"/".join(n["assetKey"]["path"]): {"/".join(d["path"]) for d in n["dependencyKeys"]} for n in nodes}
        assert deps["scoring/source_dataset"] == {"raw_prompts"}
        assert deps["scoring/sharded"] == {"scoring/source_dataset"} and deps["scoring/pending"] == {"scoring/sharded"}
        assert {"scoring/approved", "scoring/tail_retry"} <= deps["scoring/results"]
        assert deps["scored_rows"] == {"scoring/results"}

        location = graphql(port, "{ workspaceOrError { ... on Workspace { locationEntries { name } } } }")
        name = location["workspaceOrError"]["locationEntries"][0]["name"]
        params = {"selector": {"repositoryLocationName": name, "repositoryName": "__repository__", "jobName": "__ASSET_JOB",
                               "assetSelection": [{"path": ["raw_prompts"]}]}}
        launched = graphql(port, LAUNCH, {"params": params})["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched

        def latest(path: list[str]) -> dict | None:
            mats = graphql(port, LATEST, {"key": {"path": path}})["assetOrError"].get("assetMaterializations") or []
            return mats[0] if mats else None

        results = wait_for(lambda: latest(["scoring", "results"]), 600, "scoring/results (the round sensor)", proc)
        assert results["partition"].startswith("scoring-")
        approved = {e["label"]: e.get("intValue") for e in results["metadataEntries"]}["approved"]
        downstream = wait_for(lambda: latest(["scored_rows"]), 180, "scored_rows (eager automation)", proc)
        assert {e["label"]: e.get("intValue") for e in downstream["metadataEntries"]}["rows"] == approved > 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()
