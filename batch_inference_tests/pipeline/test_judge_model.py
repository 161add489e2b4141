"""A judge of its own: the judge phase and the tail's judge waves run on the judge's own
model and pool, each model loaded once per pool for the whole run.

The infer model never approves as a judge (simulated approval 0) and the judge model
always does (approval 1) or half the time: a record approved at all was judged by the
judge's model.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from click.testing import CliRunner

from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.pipeline.runner import PoolPair, open_runner
from batch_inference.pool.launchers.local import STATE_DIR_ENV, LocalLauncher
from batch_inference_tests.fixtures.pool import kill_worker
from batch_inference_tests.pipeline.helpers import spec_dict


def sim(approval: float, seed: int = 0) -> dict[str, Any]:
    return {"kind": "simulated", "seed": seed,
            "simulated": {"approval_rate": approval, "latency_a_s": 0.0002, "latency_b_s": 0.0}}


NEVER = sim(0.0)


def two_model_spec(tmp_path: Path, judge_approval: float, **overrides: Any) -> dict[str, Any]:
    data = spec_dict(tmp_path, records=overrides.pop("records", 200), **overrides)
    data["engine"] = NEVER
    data["judge"] = {**data["judge"], "engine": sim(judge_approval, seed=1)}
    return data


def ledger(spec: PipelineSpec, name: str) -> dict[str, Any]:
    return orjson.loads((Path(spec.output) / spec.run / "ledger" / f"{name}.json").read_bytes())


TAIL = {"strategy": "hybrid", "max_rounds": 3, "max_attempts": 6, "crossover": {"compare_cost": False}}


async def test_the_judge_runs_on_its_own_model_and_approves_everything_in_round_0(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(two_model_spec(tmp_path, 1.0))
    summary = await run_pipeline(spec)
    assert summary.status == "converged" and summary.rounds == 1 and summary.approved == 200
    judge, infer = ledger(spec, "round-00-judge"), ledger(spec, "round-00-infer")
    assert judge["counts"]["approved"] == 200
    assert judge["ran_on"] == {"pool": "default-judge", "model": "simulated:seed1", "adapter": None}
    assert infer["ran_on"] == {"pool": "default", "model": "simulated", "adapter": None}


async def test_without_judge_engine_the_same_run_never_approves(tmp_path: Path) -> None:
    """The control: the judge on the infer model (approval 0) approves nothing."""
    data = two_model_spec(tmp_path, 1.0, max_rounds=1)
    del data["judge"]["engine"]
    summary = await run_pipeline(PipelineSpec.parse(data))
    assert summary.approved == 0 and summary.exhausted == 200


async def test_rounds_and_the_tail_judge_on_the_judge_pool_each_engine_loaded_once(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(two_model_spec(tmp_path, 0.5, **TAIL))
    async with open_runner(spec) as runner:
        assert isinstance(runner, PoolPair)
        summary = await run_pipeline(spec, runner=runner)
        stats = await runner.stats()
    assert summary.rounds == 3 and summary.tail and summary.conservation["ok"]
    tail = ledger(spec, "tail")
    assert tail["counts"]["approved"] > 0  # approvals in place: judged by the judge's model
    assert tail["ran_on"]["judge_pool"] == "default-judge" and tail["ran_on"]["pool"] == "default"
    assert stats["infer"]["engine_loads"] == stats["judge"]["engine_loads"] == 1
    judge_tasks = sum(ledger(spec, f"round-{r:02d}-judge")["shards_run"] for r in range(3))
    assert stats["judge"]["tasks_completed"] >= judge_tasks + tail["shards_run"]  # the rounds' + the tail's waves


async def test_a_tail_task_the_judge_pool_fails_is_quarantined_with_its_judge_waves_folder(tmp_path: Path) -> None:
    """A retry task whose waves the judge pool fails after it judged some is quarantined like
    any shard: its outputs are discarded, the judge waves' scratch folder (a folder, not a
    shard) with them, and the run goes on."""
    from batch_inference.pool import TaskFailed

    spec = PipelineSpec.parse(two_model_spec(tmp_path, 0.5, strategy="in_place", max_attempts=4, shard_records=50,
                                             chunk_size=10, pool={"launcher": "inprocess", "retries": 0}))
    async with open_runner(spec) as runner:
        assert isinstance(runner, PoolPair)
        real, calls = runner.judge.run_task, {"n": 0}

        async def fails_later(task: Any) -> Any:
            if "/retry/00001/" in task.task_id:
                calls["n"] += 1
                if calls["n"] > 2:  # shard 1's first waves are judged; then the pool fails it
                    raise TaskFailed(task, ["judge pool gone"])
            return await real(task)

        runner.judge.run_task = fails_later  # type: ignore[method-assign]
        summary = await run_pipeline(spec, runner=runner)
    assert calls["n"] > 2 and summary.status == "quarantined" and summary.quarantined == 50
    (entry,) = ledger(spec, "tail")["quarantined"]
    assert "judge pool gone" in entry["error"] and entry["task_id"].endswith("/retry/00001")
    waves = Path(spec.output) / spec.run / "tail" / "judge-waves"
    assert not (waves / "part-00001").exists()


async def test_a_judge_pool_smaller_than_the_tails_tasks_is_waited_for_not_failed(tmp_path: Path) -> None:
    """Four retry tasks in flight on the infer pool, one slot on the judge pool: every wave
    that finds the judge pool busy waits for its slot; no shard is quarantined."""
    spec = PipelineSpec.parse(two_model_spec(tmp_path, 0.5, records=400, strategy="in_place", max_attempts=6,
                                             pool={"launcher": "inprocess", "concurrency": 4},
                                             judge={"pool": {"concurrency": 1}}))
    summary = await run_pipeline(spec)
    assert summary.failed == 0 and summary.quarantined == 0, summary
    assert summary.approved + summary.max_attempts == 400 and summary.approved > 300
    assert ledger(spec, "tail")["shards_run"] == 4


# -- through the CLI, on local worker pools ----------------------------------------


@pytest.fixture
def pool_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Local pools' state under the test's tmp path; every worker stopped by PID after."""
    state = tmp_path / "pool-state"
    monkeypatch.setenv(STATE_DIR_ENV, str(state))
    yield state
    for name in (p.name for p in state.iterdir()) if state.exists() else ():
        launcher = LocalLauncher(None, name=name, state_dir=state)
        pids = [s.pid for s in launcher.status()]
        launcher.down()
        for pid in pids:
            kill_worker(pid, signal.SIGKILL)


def worker_stats(name: str, state: Path) -> list[dict[str, Any]]:
    out = []
    for status in LocalLauncher(None, name=name, state_dir=state).status():
        with urllib.request.urlopen(f"{status.endpoint}/stats", timeout=10) as resp:
            out.append(json.loads(resp.read()))
    return out


def run_cli(tmp_path: Path, data: dict[str, Any]) -> Any:
    from batch_inference.cli.pipeline_cmds import run

    path = tmp_path / f"{data['run']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return CliRunner().invoke(run, [str(path)], terminal_width=160)


LOCAL = {"launcher": "local", "replicas": 1, "concurrency": 4, "idle_ttl_s": 300, "batcher": {"batch_timeout_s": 0.002}}


@pytest.mark.slow
def test_cli_on_local_pools_approves_everything_in_round_0(tmp_path: Path, pool_dir: Path) -> None:
    result = run_cli(tmp_path, two_model_spec(tmp_path, 1.0, pool=LOCAL))
    assert result.exit_code == 0, result.output
    assert "status: converged" in result.output
    (infer,), (judge,) = worker_stats("default", pool_dir), worker_stats("default-judge", pool_dir)
    assert (infer["engine_loads"], judge["engine_loads"]) == (1, 1)
    assert (infer["tasks_completed"], judge["tasks_completed"]) == (2, 2)  # 200 records / 100 per shard, one round
    assert judge["records_done"] == 200


@pytest.mark.slow
def test_cli_on_local_pools_three_rounds_and_the_tail_load_each_model_once(tmp_path: Path, pool_dir: Path) -> None:
    data = two_model_spec(tmp_path, 0.5, pool=LOCAL, **TAIL)
    result = run_cli(tmp_path, data)
    assert result.exit_code in (0, 3), result.output
    spec = PipelineSpec.parse(data)
    rounds = [ledger(spec, f"round-{r:02d}-{phase}") for r in range(3) for phase in ("infer", "judge")]
    tail = ledger(spec, "tail")
    assert tail["counts"]["approved"] > 0 and len(rounds) == 6
    (infer,), (judge,) = worker_stats("default", pool_dir), worker_stats("default-judge", pool_dir)
    # one worker per pool served the whole run: loaded once, and it ran every task of its pool
    assert (infer["engine_loads"], judge["engine_loads"]) == (1, 1)
    assert infer["tasks_completed"] == sum(p["shards_run"] for p in rounds if p["phase"] == "infer") + tail["shards_run"]
    assert judge["tasks_completed"] >= sum(p["shards_run"] for p in rounds if p["phase"] == "judge") + tail["shards_run"]
    assert os.environ[STATE_DIR_ENV] == str(pool_dir)
