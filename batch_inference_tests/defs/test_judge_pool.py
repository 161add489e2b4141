"""A judge of its own through Dagster: each pool is a resource (``pool``, ``judge_pool``);
the judge step runs on the judge's model, and metadata and ledger name where each phase ran."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from batch_inference.definitions import build_definitions
from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.keys import APPROVED, INFERRED, REJECTED, TAIL_RETRY
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference.defs.storage.resources import StorageResource
from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout
from batch_inference.pool.launchers.local import STATE_DIR_ENV, LocalLauncher
from batch_inference_tests.defs.helpers import latest
from batch_inference_tests.fixtures.pool import kill_worker


def sim(approval: float, seed: int = 0) -> dict[str, Any]:
    return {"kind": "simulated", "seed": seed, "simulated": {"latency_a_s": 0.0, "latency_b_s": 0.0, "approval_rate": approval}}


def two_models(judge_approval: float, **overrides: Any) -> dict[str, Any]:
    return {"engine": sim(0.0),  # as a judge the infer model never approves
            "judge": {"kind": "llm", "template": "Judge: {result}", "engine": sim(judge_approval, seed=1)}, **overrides}


def test_the_judge_step_runs_on_the_judge_pool_and_approves_round_0(instance, write_spec):
    defs = build_definitions(pool=PoolResource(mode="inprocess"), judge_pool=PoolResource(mode="inprocess", role="judge"),
                             storage=StorageResource())
    start_run(defs, instance, start_run_config(str(write_spec("twomodels", records=40, **two_models(1.0)))))
    result = drive(defs, instance)
    assert all(r.success for r in result.launched) and result.launched[-1].job_name == "results_job"
    assert sum(r.job_name == "round_job" for r in result.launched) == 1
    approved = latest(instance, APPROVED, "twomodels|r00")
    assert approved["records"] == 40
    assert approved["ran_on.judge.model"] == "simulated:seed1" and approved["ran_on.judge.pool"] == "default-judge"
    assert approved["ran_on.infer.model"] == "simulated" and approved["ran_on.infer.pool"] == "default"
    rejected = latest(instance, REJECTED, "twomodels|r00")
    assert rejected["decision"] == "done" and rejected["judge_pool.mode"] == "inprocess"
    inferred = latest(instance, INFERRED, "twomodels|r00")
    assert inferred["ran_on.model"] == "simulated"


def test_a_judge_pool_resource_leaves_a_spec_without_a_judge_engine_alone(write_spec):
    spec = PipelineSpec.load(write_spec("onemodel", records=4))
    judge_pool = PoolResource(mode="local", role="judge", concurrency=3)
    assert judge_pool.apply(spec) is spec and judge_pool.describe(spec) == {}
    two = PipelineSpec.load(write_spec("twomodels", records=4, **two_models(1.0)))
    placed = judge_pool.apply(two)
    assert placed.judge_pool is not None and (placed.judge_pool.launcher, placed.judge_pool.concurrency) == ("local", 3)
    assert placed.pool == two.pool  # the infer pool is the other resource's
    assert PoolResource(mode="endpoints", role="judge", endpoints=["http://127.0.0.1:9"]).apply(two).judge_pool.endpoints == [
        "http://127.0.0.1:9"]


@pytest.mark.slow
def test_local_pools_serve_three_rounds_and_the_tail_each_model_loaded_once(instance, write_spec, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    state = tmp_path / "pool-state"
    monkeypatch.setenv(STATE_DIR_ENV, str(state))
    local = {"launcher": "local", "replicas": 1, "concurrency": 4, "idle_ttl_s": 300,
             "storage_roots": [str(tmp_path)], "batcher": {"batch_timeout_s": 0.002}}
    spec_path = write_spec("tail2", records=60, strategy="hybrid", max_rounds=3, max_attempts=6,
                           crossover={"compare_cost": False}, pool=local, **two_models(0.5))
    defs = build_definitions(pool=PoolResource(mode="spec"), judge_pool=PoolResource(mode="spec", role="judge"),
                             storage=StorageResource())
    try:
        start_run(defs, instance, start_run_config(str(spec_path)))
        result = drive(defs, instance)
        assert all(r.success for r in result.launched) and result.launched[-1].job_name == "results_job"
        assert sum(r.job_name == "round_job" for r in result.launched) == 3
        assert any(r.job_name == "tail_job" for r in result.launched)
        tail = latest(instance, TAIL_RETRY, "tail2")
        assert tail["approved"] > 0  # approved in place: by the judge's model, on its pool
        assert (tail["ran_on.pool"], tail["ran_on.judge_pool"], tail["ran_on.judge_model"]) == ("default", "default-judge", "simulated:seed1")
        spec = PipelineSpec.load(spec_path)
        view = Ledger(RunLayout(spec.output, spec.run)).view()
        assert view.tail.ran_on["judge_model"] == "simulated:seed1"
        assert all(r.judge.ran_on["pool"] == "default-judge" for r in view.rounds)
        stats = {}
        for name in ("default", "default-judge"):
            (worker,) = LocalLauncher(None, name=name, state_dir=state).status()
            with urllib.request.urlopen(f"{worker.endpoint}/stats", timeout=10) as resp:
                stats[name] = json.loads(resp.read())
        # one worker per pool served every Dagster step of the run, each model loaded once
        assert stats["default"]["engine_loads"] == stats["default-judge"]["engine_loads"] == 1
        assert stats["default"]["tasks_completed"] == sum(r.infer.shards_run for r in view.rounds) + view.tail.shards_run
        assert stats["default-judge"]["tasks_completed"] >= sum(r.judge.shards_run for r in view.rounds) + view.tail.shards_run
    finally:
        for name in ("default", "default-judge"):
            launcher = LocalLauncher(None, name=name, state_dir=state)
            pids = [s.pid for s in launcher.status()]
            launcher.down()
            for pid in pids:
                kill_worker(pid, signal.SIGKILL)
