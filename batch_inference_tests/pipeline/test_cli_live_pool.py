"""The re-run sequences through the CLI, as a user runs them, on a pool left up:
`batch-inference pool up`, `run`, delete the output, `run`; edit the template, delete the
output, `run`. Every run converges on the same workers (the model stays hot)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batch_inference_tests.fixtures.pool import kill_worker
from batch_inference_tests.pipeline.helpers import spec_dict

pytestmark = pytest.mark.slow

ENGINE = {"kind": "simulated", "simulated": {"approval_rate": 1.0, "latency_a_s": 0.002, "latency_b_s": 1e-5}}
POOL = "live"


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Any]:
    """``cli(*args)`` runs ``batch-inference ARGS`` with the pool state under tmp; the pool is stopped by PID after."""
    env = {**os.environ, "BATCH_INFERENCE_POOL_DIR": str(tmp_path / "pool-state")}

    def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "batch_inference.cli.main", *args], env=env, text=True,
                              capture_output=True, timeout=timeout, cwd=tmp_path)

    def pids() -> list[int]:
        shown = run("pool", "status", "--name", POOL, "--json")
        return [w["pid"] for w in json.loads(shown.stdout or "[]") if w["healthy"]]

    run.pids = pids  # type: ignore[attr-defined]
    yield run
    started = pids()
    run("pool", "down", "--name", POOL)
    for pid in started:
        kill_worker(pid, signal.SIGKILL)


def test_rerun_sequences_through_the_cli_on_a_pool_left_up(cli: Any, tmp_path: Path) -> None:
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps(ENGINE))
    up = cli("pool", "up", "--engine-config", str(engine), "--replicas", "1", "--concurrency", "4",
             "--storage-root", str(tmp_path), "--name", POOL)
    assert up.returncode == 0, up.stderr
    workers = cli.pids()
    assert len(workers) == 1

    data = spec_dict(tmp_path, records=400, shard_records=100, engine=ENGINE, max_rounds=2, max_attempts=2,
                     judge={"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}},
                     pool={"launcher": "local", "name": POOL, "replicas": 1, "concurrency": 4, "retries": 1,
                           "storage_roots": [str(tmp_path)], "batcher": {}})
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    out = Path(data["output"])

    def run_ok(step: str) -> str:
        done = cli("run", str(spec))
        text = done.stdout + done.stderr
        assert done.returncode == 0, f"{step}: exit {done.returncode}\n{text[-3000:]}"
        assert "status: converged" in text and "conservation: OK" in text, f"{step}\n{text[-3000:]}"
        return text

    run_ok("first run")
    shutil.rmtree(out)
    run_ok("same spec, output deleted")  # a new run instance: no worker answers its tasks from memory
    shutil.rmtree(out)
    data["infer"] = {**data["infer"], "template": "Reply briefly: {prompt}"}
    spec.write_text(yaml.safe_dump(data))
    text = run_ok("template edited, output deleted")  # new task ids: no 409 for a spec changed under an id
    assert "quarantined" not in text.lower()
    assert cli.pids() == workers  # the pool left up served all three runs
