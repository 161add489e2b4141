"""``pool up`` and a spec's local pool (issue 28 item 1): no engine is a default, and a run
attaches to the pool ``pool up`` started when it fits, or says what differs when it does not."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from batch_inference.cli.main import cli
from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.pool.launchers.local import LocalLauncher
from batch_inference_tests.pipeline.helpers import spec_dict


@pytest.mark.fast
def test_pool_up_refuses_to_start_without_an_engine(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    result = CliRunner().invoke(cli, ["pool", "up", "--replicas", "1", "--state-dir", state])
    assert result.exit_code == 2 and "--engine-config" in result.output and "--simulated-engine" in result.output, result.output
    engine = tmp_path / "engine.json"
    engine.write_text('{"kind": "simulated"}')
    both = CliRunner().invoke(cli, ["pool", "up", "--engine-config", str(engine), "--simulated-engine", "--state-dir", state])
    assert both.exit_code == 2 and "not both" in both.output
    assert not (tmp_path / "state").exists()  # nothing was started


def _pool_up(tmp_path: Path, engine: dict, state: Path) -> list[str]:
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    up = subprocess.run([sys.executable, "-m", "batch_inference.cli.main", "pool", "up", "--engine-config", str(tmp_path / "engine.json"),
                         "--replicas", "1", "--concurrency", "3", "--storage-root", str(tmp_path), "--state-dir", str(state)],
                        capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    return up.stdout.split()


@pytest.mark.process
async def test_a_run_attaches_to_the_pool_pool_up_started_or_says_what_differs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "pools"
    monkeypatch.setenv("BATCH_INFERENCE_POOL_DIR", str(state))
    data = spec_dict(tmp_path, records=60, max_rounds=1, pool={"launcher": "local", "replicas": 1, "batcher": {}})
    pids: set[int] = set()
    try:
        endpoints = _pool_up(tmp_path, data["engine"], state)
        (first,) = LocalLauncher(None, state_dir=state).status()
        pids.add(first.pid)
        # the spec asks for its own roots (its input and output) and 4 slots: the pool's root holds them
        summary = await run_pipeline(PipelineSpec.parse(data))
        assert summary.conservation["ok"]
        (after,) = LocalLauncher(None, state_dir=state).status()
        assert (after.pid, after.endpoint) == (first.pid, first.endpoint) and after.healthy and endpoints == [first.endpoint]
        assert after.detail.get("tasks_completed", 0) > 0 or after.detail.get("engine_loads") == 1
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "replaced" in r.getMessage()]
        # another engine does not fit: replaced, and the warning names what differs
        other = {**data, "run": "other-engine", "engine": {**data["engine"], "simulated": {**data["engine"]["simulated"], "approval_rate": 0.9}}}
        with caplog.at_level(logging.WARNING, logger="batch_inference.pool.launchers.local"):
            await run_pipeline(PipelineSpec.parse(other))
        (new,) = LocalLauncher(None, state_dir=state).status()
        pids.add(new.pid)
        assert new.pid != first.pid
        (warning,) = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
        assert f"pid {first.pid}" in warning and "engine.simulated.approval_rate: 0.5 -> 0.9" in warning, warning
    finally:
        LocalLauncher(None, state_dir=state).down()
        for pid in pids:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
